// metrics.jsonl writer and progress display (see metrics.h).
#include "spes/train/metrics.h"

#include <fmt/format.h>
#include <unistd.h>

#include "spes/common/error.h"

namespace spes {

MetricsLog::MetricsLog(const std::string& path) {
  f_ = std::fopen(path.c_str(), "a");
  SPES_CHECK(f_, "cannot open '{}' for writing metrics", path);
  std::fseek(f_, 0, SEEK_END);
  had_lines_ = std::ftell(f_) > 0;
}

MetricsLog::~MetricsLog() {
  if (f_) std::fclose(f_);
}

void MetricsLog::write(const nlohmann::json& record) {
  const std::string line = record.dump() + "\n";
  std::fwrite(line.data(), 1, line.size(), f_);
  std::fflush(f_);
}

ProgressMode progress_mode_from_string(const std::string& s) {
  if (s == "auto") return ProgressMode::Auto;
  if (s == "bar") return ProgressMode::Bar;
  if (s == "lines") return ProgressMode::Lines;
  if (s == "none") return ProgressMode::None;
  fail("--progress must be auto, bar, lines or none, found '{}'", s);
}

std::string format_duration(double s) {
  if (s < 0 || s != s) return "?";
  const int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02d}m", t / 3600, (t % 3600) / 60);
  if (t >= 60) return fmt::format("{}m{:02d}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

ProgressDisplay::ProgressDisplay(int64_t first_step, int64_t total_steps, ProgressMode mode,
                                 std::string prefix)
    : first_(first_step), total_(total_steps), mode_(mode), prefix_(std::move(prefix)) {
  if (mode_ == ProgressMode::Auto) mode_ = isatty(STDERR_FILENO) ? ProgressMode::Bar
                                                                 : ProgressMode::Lines;
  start_ = last_line_ = std::chrono::steady_clock::now();
}

void ProgressDisplay::update(int64_t step, double loss, double tokens_per_s, double val_loss) {
  if (mode_ == ProgressMode::None) return;
  if (val_loss >= 0) last_val_ = val_loss;
  const auto now = std::chrono::steady_clock::now();
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double done = static_cast<double>(step - first_);
  const double eta = done > 0 ? elapsed / done * static_cast<double>(total_ - step) : -1;
  const std::string val = last_val_ >= 0 ? fmt::format(" | val {:.3f}", last_val_) : "";
  if (mode_ == ProgressMode::Bar) {
    constexpr int kWidth = 24;
    const int filled = total_ > 0 ? static_cast<int>(kWidth * step / total_) : kWidth;
    std::string bar;
    for (int i = 0; i < kWidth; ++i) bar += i < filled ? "#" : "-";
    std::fprintf(stderr, "\r%s[%s] %lld/%lld | loss %.4f%s | %.0f tok/s | ETA %s   ",
                 prefix_.c_str(), bar.c_str(), static_cast<long long>(step),
                 static_cast<long long>(total_), loss, val.c_str(), tokens_per_s,
                 format_duration(eta).c_str());
    std::fflush(stderr);
    drawn_ = true;
    return;
  }
  // Lines: at most one line every 2 seconds, plus evaluation steps and the last step.
  const double since = std::chrono::duration<double>(now - last_line_).count();
  if (since < 2.0 && val_loss < 0 && step != total_) return;
  last_line_ = now;
  std::fprintf(stderr, "%sstep %lld/%lld | loss %.4f%s | %.0f tok/s | ETA %s\n", prefix_.c_str(),
               static_cast<long long>(step), static_cast<long long>(total_), loss, val.c_str(),
               tokens_per_s, format_duration(eta).c_str());
  std::fflush(stderr);
}

void ProgressDisplay::finish() {
  if (drawn_) std::fprintf(stderr, "\n");
  drawn_ = false;
}

}  // namespace spes
