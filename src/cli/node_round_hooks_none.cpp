// The `spes` binary's nodes run their rounds without hooks (see node_round_hooks.h).
#include "cli/node_round_hooks.h"

namespace spes::cli {

std::shared_ptr<sync::NodeRoundHooks> node_round_hooks(int64_t) { return nullptr; }

}  // namespace spes::cli
