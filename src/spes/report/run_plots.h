// The standard charts of runs, as SVG files (`spes plot`): for one run, its loss curves
// (training loss per node, smoothed, and validation loss against cluster tokens) and, for a
// cluster run, bytes per round, round latency and the merge coefficient, and the mean pairwise
// cosine similarity of experts per layer; for several runs, validation (or training) loss
// against tokens side by side. Every chart of one cluster run marks where its ownership epochs
// start (experts handed from departed nodes to live ones: epoch_marks.h).
#pragma once
#include <string>
#include <vector>

#include "spes/report/run_data.h"

namespace spes::report {

// Writes OUT_DIR/loss.svg (+ rounds.svg, expert_similarity.svg for cluster runs with rounds);
// returns the paths written.
std::vector<std::string> write_run_plots(const RunData& run, const std::string& out_dir,
                                         int64_t smooth);

// metric: "val_loss" or "loss" (training loss, smoothed).
void write_comparison_plot(const std::vector<RunData>& runs, const std::string& path,
                           const std::string& metric, int64_t smooth);

}  // namespace spes::report
