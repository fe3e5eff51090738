// Side-by-side comparison of finished runs as a Markdown table (`spes compare`): final
// validation loss, tokens, peak RSS, gradient + optimizer bytes and bytes per round per node,
// each measured figure next to the SPES.md formula for the run's config (transfer_formula.h).
#pragma once
#include <string>
#include <vector>

#include "spes/report/run_data.h"

namespace spes::report {

// One row per run; runs without a config (an old run directory) show "-" for the formulas.
std::string markdown_comparison(const std::vector<RunData>& runs);

}  // namespace spes::report
