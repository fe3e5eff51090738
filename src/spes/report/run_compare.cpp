// Markdown comparison of runs (see run_compare.h).
#include "spes/report/run_compare.h"

#include <fmt/format.h>

#include <cmath>

#include "spes/common/strings.h"
#include "spes/report/transfer_formula.h"

namespace spes::report {

namespace {

// "measured (= formula)", or the formula next to it; for transfers the safetensors header of
// the stream (names, shapes, offsets) makes up the difference.
std::string vs(double measured, double formula, bool have_formula, bool header) {
  if (measured <= 0 && (!have_formula || formula <= 0)) return "-";
  std::string s = measured > 0 ? human_bytes(measured) : std::string("-");
  if (!have_formula) return s;
  if (measured == formula) return s + " (= formula)";
  if (header && measured > formula)
    return s + fmt::format(" (formula {} + {:.1f} KiB header)", human_bytes(formula),
                           (measured - formula) / 1024);
  return s + fmt::format(" (formula {})", human_bytes(formula));
}

}  // namespace

std::string markdown_comparison(const std::vector<RunData>& runs) {
  std::string out =
      "| run | mode | nodes | tokens | final val loss | peak RSS / node | grad + AdamW / node "
      "| up / round / node | down / round / node | down, merge rounds | rounds |\n"
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";
  for (const auto& run : runs) {
    const RunSummary s = summarize(run);
    const bool have = run.config.has_value();
    TransferFormula f;
    if (have) f = transfer_formula(*run.config, 0);
    if (have && !run.cluster) f.mode = SyncMode::Centralized;
    const std::string mode = have ? Choice<SyncMode>(f.mode).name() : "-";
    const double mem = static_cast<double>(s.grad_bytes + s.optimizer_state_bytes);
    out += fmt::format(
        "| {} | {} | {} | {} | {} | {:.0f} MiB | {} | {} | {} | {} | {} |\n", run.label, mode,
        s.nodes, s.tokens, std::isfinite(s.final_val_loss)
                               ? fmt::format("{:.4f}", s.final_val_loss) : std::string("-"),
        s.peak_rss_mb, vs(mem, static_cast<double>(f.grad_and_optimizer_bytes()), have, false),
        vs(s.bytes_up, static_cast<double>(f.upload_bytes()), have, true),
        vs(s.bytes_down_plain, static_cast<double>(f.download_bytes()), have, true),
        s.bytes_down_merge > 0 ? vs(s.bytes_down_merge,
                                    static_cast<double>(f.download_merge_bytes()), have, true)
                               : std::string("-"),
        s.rounds);
  }
  return out;
}

}  // namespace spes::report
