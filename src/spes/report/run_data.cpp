// Run directories for reports and plots (see run_data.h).
#include "spes/report/run_data.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>

#include "spes/common/error.h"
#include "spes/io/files.h"
#include "spes/io/run_layout.h"
#include "spes/io/sync_record.h"

namespace spes::report {
namespace fs = std::filesystem;

RunData load_run(const std::string& dir, const std::string& label) {
  RunData run;
  run.dir = dir;
  run.label = label.empty() ? fs::path(dir).lexically_normal().filename().string() : label;
  if (run.label.empty()) run.label = dir;
  namespace layout = run_layout;
  if (fs::exists(layout::metrics(layout::cluster_node(dir, 0)))) {
    run.cluster = true;
    for (int64_t i = 0; fs::exists(layout::metrics(layout::cluster_node(dir, i))); ++i)
      run.nodes.push_back(read_jsonl(layout::metrics(layout::cluster_node(dir, i))));
    run.rounds = read_jsonl(layout::rounds_log(layout::cluster_server(dir)));
    if (fs::exists(layout::cluster_config(dir)))
      run.config = config_load(layout::cluster_config(dir));
  } else if (fs::exists(layout::metrics(dir))) {
    run.nodes.push_back(read_jsonl(layout::metrics(dir)));
    const std::string ckpt_config = layout::checkpoint_config(layout::checkpoint(dir));
    if (fs::exists(ckpt_config)) run.config = config_load(ckpt_config);
  } else {
    fail("'{}' is not a run directory: expected metrics.jsonl (`spes train --out`) or "
         "node0/metrics.jsonl (`spes launch --out`)", dir);
  }
  for (size_t i = 0; i < run.nodes.size(); ++i)
    SPES_CHECK(!run.nodes[i].empty(), "'{}': the metrics of node {} are empty (the run has not "
               "finished a step yet)", dir, i);
  return run;
}

std::map<int64_t, double> cluster_tokens_by_step(const RunData& run) {
  std::map<int64_t, double> tokens;
  std::map<int64_t, int64_t> seen;
  for (const auto& lines : run.nodes)
    for (const auto& l : lines)
      if (l.contains("step") && l.contains("tokens")) {
        const int64_t s = l["step"].get<int64_t>();
        tokens[s] += l["tokens"].get<double>();
        seen[s] += 1;
      }
  // A node that has not logged a step yet counts as the average of those that have.
  const double n = static_cast<double>(run.nodes.size());
  for (auto& [s, t] : tokens) t = t / static_cast<double>(seen[s]) * n;
  return tokens;
}

namespace {

std::map<int64_t, std::pair<double, int64_t>> mean_by_step(const RunData& run, int64_t node,
                                                           const char* key) {
  std::map<int64_t, std::pair<double, int64_t>> acc;  // step -> (sum, count)
  for (size_t i = 0; i < run.nodes.size(); ++i) {
    if (node >= 0 && static_cast<int64_t>(i) != node) continue;
    for (const auto& l : run.nodes[i])
      if (l.contains(key) && l.contains("step")) {
        auto& a = acc[l["step"].get<int64_t>()];
        a.first += l[key].get<double>();
        a.second += 1;
      }
  }
  return acc;
}

}  // namespace

Series val_loss_series(const RunData& run) {
  Series s;
  s.label = run.label;
  s.markers = true;
  const auto tokens = cluster_tokens_by_step(run);
  for (const auto& [step, a] : mean_by_step(run, -1, "val_loss")) {
    const auto it = tokens.find(step);
    if (it == tokens.end()) continue;
    s.x.push_back(it->second);
    s.y.push_back(a.first / static_cast<double>(a.second));
  }
  return s;
}

Series train_loss_series(const RunData& run, int64_t node, int64_t smooth) {
  Series s;
  s.label = node < 0 ? run.label : fmt::format("{} node {}", run.label, node);
  const auto tokens = cluster_tokens_by_step(run);
  std::vector<double> xs, ys;
  for (const auto& [step, a] : mean_by_step(run, node, "loss")) {
    const auto it = tokens.find(step);
    if (it == tokens.end()) continue;
    xs.push_back(it->second);
    ys.push_back(a.first / static_cast<double>(a.second));
  }
  const size_t w = static_cast<size_t>(std::max<int64_t>(1, smooth));
  double sum = 0;
  for (size_t i = 0; i < ys.size(); ++i) {
    sum += ys[i];
    if (i >= w) sum -= ys[i - w];
    s.x.push_back(xs[i]);
    s.y.push_back(sum / static_cast<double>(std::min(i + 1, w)));
  }
  return s;
}

RunSummary summarize(const RunData& run) {
  RunSummary r;
  r.nodes = static_cast<int64_t>(run.nodes.size());
  const auto tokens = cluster_tokens_by_step(run);
  if (!tokens.empty()) {
    r.steps = tokens.rbegin()->first;
    r.tokens = static_cast<int64_t>(std::llround(tokens.rbegin()->second));
  }
  const auto val = mean_by_step(run, -1, "val_loss");
  if (!val.empty())
    r.final_val_loss = val.rbegin()->second.first / static_cast<double>(val.rbegin()->second.second);
  for (const auto& lines : run.nodes)
    for (const auto& l : lines) r.peak_rss_mb = std::max(r.peak_rss_mb, l.value("peak_rss_mb", 0.0));
  for (const auto& rd : run.rounds)
    r.server_peak_rss_mb = std::max(r.server_peak_rss_mb, rd.value("peak_rss_mb", 0.0));
  r.rounds = static_cast<int64_t>(run.rounds.size());
  double up = 0, plain = 0, merge = 0;
  int64_t n_up = 0, n_plain = 0, n_merge = 0;
  for (const auto& l : run.nodes[0]) {
    if (l.contains("memory")) {
      const auto& m = l["memory"];
      r.trainable_numel = m.value("trainable_numel", int64_t{0});
      r.grad_bytes = m.value("grad_bytes", int64_t{0});
      r.optimizer_state_bytes = m.value("optimizer_state_bytes", int64_t{0});
    }
    r.seconds += l.value("step_s", 0.0);
    if (!l.contains("sync")) continue;
    const auto& s = l["sync"];
    // The time training stood still for the round (with overlap: only the wait to apply it).
    r.seconds += s.value("blocked_s", s.value("seconds", 0.0));
    up += sync_record_bytes_up(s);
    ++n_up;
    if (s.value("alpha", 0.0) > 0) {
      merge += sync_record_bytes_down(s);
      ++n_merge;
    } else {
      plain += sync_record_bytes_down(s);
      ++n_plain;
    }
  }
  if (n_up) r.bytes_up = up / static_cast<double>(n_up);
  if (n_plain) r.bytes_down_plain = plain / static_cast<double>(n_plain);
  if (n_merge) r.bytes_down_merge = merge / static_cast<double>(n_merge);
  return r;
}

}  // namespace spes::report
