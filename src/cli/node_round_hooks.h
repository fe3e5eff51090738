// The round hooks `spes node` gives its sync client (src/spes/sync/node/round_hooks.h). Which
// definition a binary links decides: the `spes` binary's (node_round_hooks_none.cpp) gives
// none; the test-only `spes_fault_node` (tests/fault_node/) gives the reliability tests' fault
// injection. No environment variable or global reaches a production node's round.
#pragma once
#include <cstdint>
#include <memory>

#include "spes/sync/node/round_hooks.h"

namespace spes::cli {

std::shared_ptr<sync::NodeRoundHooks> node_round_hooks(int64_t node_id);

}  // namespace spes::cli
