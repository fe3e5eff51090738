// Reading a finished (or running) run directory for reports and plots: a single-node run
// (`spes train`: DIR/metrics.jsonl) or a local cluster (`spes launch`: DIR/node<i>/metrics.jsonl
// and DIR/server/rounds.jsonl), with its config; curves of loss against the tokens seen by the
// whole cluster, and the run's end figures (loss, memory, bytes per round).
#pragma once
#include <nlohmann/json.hpp>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "spes/io/config.h"
#include "spes/report/svg_chart.h"

namespace spes::report {

struct RunData {
  std::string dir;
  std::string label;                               // legend / table name (default: dir name)
  bool cluster = false;                            // a `spes launch` directory
  std::vector<std::vector<nlohmann::json>> nodes;  // metrics.jsonl lines per node
  std::vector<nlohmann::json> rounds;              // server rounds.jsonl (cluster runs)
  std::optional<Config> config;                    // DIR/config.yaml or the checkpoint's
};

// Fails with a clear message when DIR holds neither kind of run.
RunData load_run(const std::string& dir, const std::string& label = "");

// step -> tokens seen by the whole cluster at that step (each node's own count, summed; a node
// that has not logged the step counts as the average of those that have).
std::map<int64_t, double> cluster_tokens_by_step(const RunData& run);

// Validation loss (mean over nodes evaluated at that step) against tokens seen by the cluster.
Series val_loss_series(const RunData& run);
// Training loss against cluster tokens; node < 0: mean over nodes. Moving average over
// `smooth` steps (1: raw).
Series train_loss_series(const RunData& run, int64_t node, int64_t smooth);

struct RunSummary {
  int64_t nodes = 0, steps = 0, rounds = 0;
  int64_t tokens = 0;                  // whole cluster
  double final_val_loss = NAN;         // mean over nodes at the last evaluation
  double peak_rss_mb = 0;              // the largest node's peak RSS
  double server_peak_rss_mb = 0;
  int64_t trainable_numel = 0;         // node 0 (from the "memory" record)
  int64_t grad_bytes = 0;              // node 0, measured on the tensors after backward
  int64_t optimizer_state_bytes = 0;   // node 0
  double bytes_up = 0;                 // node 0, mean per round (on the wire: io/sync_record.h)
  double bytes_down_plain = 0;         // node 0, mean over rounds without merging
  double bytes_down_merge = 0;         // node 0, mean over merge rounds (0 when none)
  double seconds = 0;                  // node 0: training step times + sync times
};

RunSummary summarize(const RunData& run);

}  // namespace spes::report
