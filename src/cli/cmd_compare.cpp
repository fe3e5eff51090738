// `spes compare`: a Markdown table of finished runs (final validation loss, peak RSS, gradient +
// optimizer bytes and bytes per round per node, each next to the SPES.md formula).
#include <cstdio>

#include "cli/command.h"
#include "spes/common/error.h"
#include "spes/report/run_compare.h"

namespace {

struct CompareArgs {
  std::vector<std::string> dirs, labels;
};

spes::cli::SubcommandRegistrar register_compare("compare", "Compare runs side by side as a Markdown table",
                                   [](CLI::App& sub) {
  auto a = std::make_shared<CompareArgs>();
  sub.add_option("dirs", a->dirs, "Run directories (spes train --out or spes launch --out)")
      ->required();
  sub.add_option("--labels", a->labels, "Row names, one per run")->delimiter(',');
  sub.callback([a] {
    SPES_CHECK(a->labels.empty() || a->labels.size() == a->dirs.size(),
               "--labels: {} labels for {} run directories", a->labels.size(), a->dirs.size());
    std::vector<spes::report::RunData> runs;
    for (size_t i = 0; i < a->dirs.size(); ++i)
      runs.push_back(spes::report::load_run(a->dirs[i], a->labels.empty() ? "" : a->labels[i]));
    std::fputs(spes::report::markdown_comparison(runs).c_str(), stdout);
  });
}, spes::cli::GpuUse::Never);

}  // namespace
