// Run observability: DIR/metrics.jsonl (one JSON object per step, appended and flushed; a
// restart adds a line {"event": "restart", ...} and never truncates it) and a
// terminal progress display (a redrawn bar on a TTY, periodic lines otherwise).
#pragma once
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <string>

namespace spes {

class MetricsLog {
 public:
  // Opens DIR/metrics.jsonl for appending: its history is never truncated (a run started
  // again in the same directory, with or without a checkpoint, adds to it; see
  // had_lines()).
  explicit MetricsLog(const std::string& path);
  ~MetricsLog();
  void write(const nlohmann::json& record);
  // Whether the file held lines before this process opened it (a restart).
  bool had_lines() const { return had_lines_; }

 private:
  std::FILE* f_ = nullptr;
  bool had_lines_ = false;
};

enum class ProgressMode { Auto, Bar, Lines, None };
ProgressMode progress_mode_from_string(const std::string& s);

class ProgressDisplay {
 public:
  ProgressDisplay(int64_t first_step, int64_t total_steps, ProgressMode mode,
                  std::string prefix = "");
  // Shows step, loss, tokens/s and ETA; `val_loss` < 0 means not evaluated at this step.
  void update(int64_t step, double loss, double tokens_per_s, double val_loss);
  void finish();

 private:
  int64_t first_, total_;
  ProgressMode mode_;
  std::string prefix_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_line_;
  double last_val_ = -1;
  bool drawn_ = false;
};

// "1h02m", "3m05s", "42s".
std::string format_duration(double seconds);

}  // namespace spes
