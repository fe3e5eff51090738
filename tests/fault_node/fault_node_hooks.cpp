// The round hooks of `spes_fault_node`, the test-only build of the `spes` binary: a node run
// with SPES_SYNC_FAULTS misbehaves as node_faults.h describes; without it, it runs as `spes`
// does. Every other subcommand is the `spes` binary's own.
#include <spdlog/spdlog.h>

#include "cli/node_round_hooks.h"
#include "fault_node/node_faults.h"

namespace spes::cli {

std::shared_ptr<sync::NodeRoundHooks> node_round_hooks(int64_t node_id) {
  const sync::NodeFaults faults = sync::node_faults_from_env();
  if (!faults.any()) return nullptr;
  return std::make_shared<sync::NodeFaultInjection>(faults, node_id);
}

}  // namespace spes::cli
