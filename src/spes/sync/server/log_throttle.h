// Keeps repeated log lines of one kind from flooding the log: per key (e.g. the source of a
// refused call, the RPC and the refusal's code), the first line of a window of `window_s`
// seconds is logged; the rest of the window's lines are counted, and once the window has
// passed, one summary line says how many there were ("... (37 more like this in the last
// 10 s)"). On top of that, at most `max_lines` lines in all are logged in any window of
// `window_s` (from many sources, e.g. a stranger rotating addresses, every key's first line
// would otherwise still reach the log): the rest are counted, and the next flush() after the
// window says how many there were and the last of them, in one line. The clock is injected for
// tests. Thread-safe. Holds at most `max_keys` keys (a flood of distinct keys shares one
// overflow key). Leaves out: the logging itself (the caller logs the lines it is given).
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace spes::sync {

class LogThrottle {
 public:
  using Clock = std::chrono::steady_clock;
  explicit LogThrottle(double window_s = 10, std::function<Clock::time_point()> now = Clock::now,
                       size_t max_keys = 4096, uint64_t max_lines = 100);

  // The line to log now for `message` of kind `key` (the message, or nothing when a line of the
  // key was logged less than window_s ago: then it is counted for the summary).
  std::optional<std::string> admit(const std::string& key, const std::string& message);
  // The summaries of windows that have passed with lines held back: the last such message
  // with " (N more like this in the last W s)", one per key (at most max_lines of them; the
  // rest go into the total's count); then, when the total cap held lines back in a window that
  // has passed, one line with their count and the last of them. Forgets the keys whose window
  // passed. Call it periodically.
  std::vector<std::string> flush();
  size_t keys() const;

 private:
  struct Window {
    Clock::time_point start;
    uint64_t held = 0;  // lines held back in this window
    std::string last;   // the last of them
  };
  std::string summary(const Window& w) const;
  // Whether one more line fits the total cap (counted), else held back as `message`; mu_ held.
  bool take_total(Clock::time_point now, const std::string& message);

  const double window_s_;
  const std::function<Clock::time_point()> now_;
  const size_t max_keys_;
  const uint64_t max_lines_;
  mutable std::mutex mu_;
  std::map<std::string, Window> windows_;
  Window total_;             // lines logged in the current total window: held = over the cap
  uint64_t total_lines_ = 0;
  bool total_started_ = false;
  Clock::time_point held_since_;  // when the cap held back its first line not yet reported
};

}  // namespace spes::sync
