// Standard run charts (see run_plots.h).
#include "spes/report/run_plots.h"

#include <fmt/format.h>

#include <filesystem>

#include "spes/common/error.h"
#include "spes/io/files.h"
#include "spes/report/epoch_marks.h"

namespace spes::report {
namespace fs = std::filesystem;

namespace {

ChartOptions titled(const std::string& title, const std::string& x, const std::string& y) {
  ChartOptions o;
  o.title = title;
  o.x_label = x;
  o.y_label = y;
  o.integer_x = true;  // every run chart's x counts something: tokens, rounds or steps
  return o;
}

void write_chart(const std::string& path, const std::vector<Series>& series,
                 const ChartOptions& o) {
  file_write_atomic(path, render_line_chart(series, o));
}

// The run's ownership epoch starts as marks on a chart whose x is `axis`.
enum class Axis { Tokens, Round, Step };
ChartOptions with_epoch_marks(ChartOptions o, const std::vector<EpochStart>& starts, Axis axis) {
  for (const auto& e : starts)
    o.marks.push_back({axis == Axis::Tokens  ? e.tokens
                       : axis == Axis::Round ? static_cast<double>(e.round)
                                             : static_cast<double>(e.step),
                       e.label});
  return o;
}

}  // namespace

std::vector<std::string> write_run_plots(const RunData& run, const std::string& out_dir,
                                         int64_t smooth) {
  fs::create_directories(out_dir);
  std::vector<std::string> written;
  const std::vector<EpochStart> epochs = epoch_starts(run);
  std::vector<Series> loss;
  for (int64_t i = 0; i < static_cast<int64_t>(run.nodes.size()); ++i) {
    Series s = train_loss_series(run, run.cluster ? i : -1, smooth);
    s.label = run.cluster ? fmt::format("train, node {}", i) : "train";
    loss.push_back(std::move(s));
  }
  Series val = val_loss_series(run);
  val.label = "validation";
  if (!val.x.empty()) loss.push_back(std::move(val));
  write_chart(out_dir + "/loss.svg", loss,
              with_epoch_marks(titled(run.label + ": loss", "tokens (whole cluster)",
                                      "loss (nats/token)"),
                               epochs, Axis::Tokens));
  written.push_back(out_dir + "/loss.svg");
  if (!run.cluster || run.rounds.empty()) return written;

  Series in{"bytes in (all nodes)", {}, {}, true}, out{"bytes out (all nodes)", {}, {}, true};
  Series secs{"seconds (first upload to published)", {}, {}, true};
  Series alpha{"merge alpha x 100", {}, {}, true};
  std::vector<Series> cos;
  for (const auto& r : run.rounds) {
    const double round = r.value("round", 0.0);
    in.x.push_back(round);
    in.y.push_back(r.value("bytes_in", 0.0) / (1 << 20));
    if (r.contains("bytes_out")) {
      out.x.push_back(round);
      out.y.push_back(r["bytes_out"].get<double>() / (1 << 20));
    }
    secs.x.push_back(round);
    secs.y.push_back(r.value("seconds", 0.0));
    alpha.x.push_back(round);
    alpha.y.push_back(100 * r.value("alpha", 0.0));
    if (r.contains("gate_cos") && r["gate_cos"].is_array()) {
      const auto& c = r["gate_cos"];
      if (cos.size() < c.size()) cos.resize(c.size());
      for (size_t l = 0; l < c.size(); ++l) {
        cos[l].label = fmt::format("layer {}", l);
        cos[l].markers = true;
        cos[l].x.push_back(r.value("step", 0.0));
        cos[l].y.push_back(c[l].get<double>());
      }
    }
  }
  std::vector<Series> bytes = {in};
  if (!out.x.empty()) bytes.push_back(out);
  write_chart(out_dir + "/rounds.svg", bytes,
              with_epoch_marks(titled(run.label + ": bytes per round", "round", "MiB"), epochs,
                               Axis::Round));
  write_chart(out_dir + "/round_time.svg", {secs, alpha},
              with_epoch_marks(titled(run.label + ": round latency and merging", "round",
                                      "seconds | alpha x 100"),
                               epochs, Axis::Round));
  written.push_back(out_dir + "/rounds.svg");
  written.push_back(out_dir + "/round_time.svg");
  if (!cos.empty()) {
    write_chart(out_dir + "/expert_similarity.svg", cos,
                with_epoch_marks(titled(run.label + ": mean pairwise cosine of experts' "
                                                    "gate_proj",
                                        "step", "cosine"),
                                 epochs, Axis::Step));
    written.push_back(out_dir + "/expert_similarity.svg");
  }
  return written;
}

void write_comparison_plot(const std::vector<RunData>& runs, const std::string& path,
                           const std::string& metric, int64_t smooth) {
  SPES_CHECK(metric == "val_loss" || metric == "loss",
             "--metric '{}': expected val_loss or loss", metric);
  std::vector<Series> series;
  for (const auto& run : runs) {
    Series s = metric == "val_loss" ? val_loss_series(run) : train_loss_series(run, -1, smooth);
    s.label = run.label;
    SPES_CHECK(!s.x.empty(), "'{}' has no {} values to plot{}", run.dir, metric,
               metric == "val_loss" ? " (set eval_interval > 0)" : "");
    series.push_back(std::move(s));
  }
  const std::string what = metric == "val_loss" ? "validation loss" : "training loss";
  const fs::path parent = fs::path(path).parent_path();
  if (!parent.empty()) fs::create_directories(parent);
  write_chart(path, series, titled(what + " against tokens", "tokens (whole cluster)",
                                   what + " (nats/token)"));
}

}  // namespace spes::report
