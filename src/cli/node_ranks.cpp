// Starting a node's rank processes from `spes train` / `spes node` (see node_ranks.h).
#include "cli/node_ranks.h"

#include "cli/command.h"
#include "spes/cluster/rank_launcher.h"

namespace spes::cli {

bool run_node_ranks(const Config& cfg, int64_t nproc) {
  if (nproc <= 1 || running_as_rank()) return false;
  RankLaunchOptions lo;
  lo.nproc = nproc;
  lo.args = command_line_args();
  const int code = launch_ranks(cfg, lo);
  if (code != 0) exit_with(code);
  return true;
}

}  // namespace spes::cli
