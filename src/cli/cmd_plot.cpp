// `spes plot`: renders a run's loss curves and round statistics to SVG (no Python needed), or,
// given several runs and --out, their loss against tokens in one chart.
#include <cstdio>

#include "cli/command.h"
#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/report/run_plots.h"

namespace {

struct PlotArgs {
  std::vector<std::string> dirs, labels;
  std::string out, metric = "val_loss";
  int64_t smooth = 10;
};

void run_plot(const PlotArgs& a) {
  SPES_CHECK(a.labels.empty() || a.labels.size() == a.dirs.size(),
             "--labels: {} labels for {} run directories", a.labels.size(), a.dirs.size());
  std::vector<spes::report::RunData> runs;
  for (size_t i = 0; i < a.dirs.size(); ++i)
    runs.push_back(spes::report::load_run(a.dirs[i], a.labels.empty() ? "" : a.labels[i]));
  if (runs.size() == 1 && (a.out.empty() || !spes::ends_with(a.out, ".svg"))) {
    const std::string dir = a.out.empty() ? a.dirs[0] + "/plots" : a.out;
    for (const auto& p : spes::report::write_run_plots(runs[0], dir, a.smooth))
      std::printf("wrote %s\n", p.c_str());
    return;
  }
  SPES_CHECK(spes::ends_with(a.out, ".svg"), "several runs make one chart: give --out FILE.svg");
  spes::report::write_comparison_plot(runs, a.out, a.metric, a.smooth);
  std::printf("wrote %s\n", a.out.c_str());
}

spes::cli::SubcommandRegistrar register_plot("plot", "Plot a run's curves, or compare runs, as SVG",
                                   [](CLI::App& sub) {
  auto a = std::make_shared<PlotArgs>();
  sub.add_option("dirs", a->dirs, "Run directories (spes train --out or spes launch --out)")
      ->required();
  sub.add_option("--out", a->out, "One run: output directory (default DIR/plots); several "
                 "runs: the .svg file");
  sub.add_option("--labels", a->labels, "Legend names, one per run")->delimiter(',');
  sub.add_option("--metric", a->metric, "Comparison metric: val_loss or loss")
      ->capture_default_str();
  sub.add_option("--smooth", a->smooth, "Moving average of the training loss, in steps")
      ->capture_default_str();
  sub.callback([a] { run_plot(*a); });
}, spes::cli::GpuUse::Never);

}  // namespace
