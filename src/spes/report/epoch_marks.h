// Where a cluster run's ownership epochs start (docs/PROTOCOL.md, "Ownership epochs"), read from
// the server's rounds.jsonl: each round line that decided a new epoch (its "ownership_next" and
// "handoffs") gives one start: the first round under the new map, the step from which the
// nodes train under it (the deciding round's), the cluster tokens at that step, and a label such
// as "epoch 1: 2 experts 3->0,1" (how many experts moved, from which nodes to which). `spes plot`
// marks them on every chart of the run (run_plots.h).
#pragma once
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "spes/report/run_data.h"

namespace spes::report {

struct EpochStart {
  int64_t epoch = 0;
  int64_t round = 0;    // the first round under the new map
  int64_t step = 0;     // the nodes train under it after this step
  double tokens = NAN;  // cluster tokens at `step` (NAN: no node logged that step)
  std::string label;
};

// In round order; empty for a run without handoffs (or a single-node run).
std::vector<EpochStart> epoch_starts(const RunData& run);

}  // namespace spes::report
