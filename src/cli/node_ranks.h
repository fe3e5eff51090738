// `--nproc-per-node N` for `spes train` and `spes node`: the first process starts the N rank
// processes (cluster/rank_launcher.h) with its own arguments and waits for them.
#pragma once
#include <cstdint>

#include "spes/io/config.h"

namespace spes::cli {

// With nproc > 1 in the first process: runs the ranks to completion (their exit code becomes
// this command's) and returns true; the subcommand is then done. Otherwise (nproc 1, or this
// is one of the ranks) returns false.
bool run_node_ranks(const Config& cfg, int64_t nproc);

}  // namespace spes::cli
