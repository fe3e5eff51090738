// Keeps repeated log lines of one kind from flooding the log: per key (e.g. the source of a
// refused call, the RPC and the refusal's code), the first line of a window of `window_s`
// seconds is logged; the rest of the window's lines are counted, and once the window has
// passed, one summary line says how many there were ("... (37 more like this in the last
// 10 s)"). The clock is injected for tests. Thread-safe. Holds at most `max_keys` keys (a flood
// of distinct keys shares one overflow key). Leaves out: the logging itself (the caller logs
// the lines it is given).
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
                       size_t max_keys = 4096);

  // The line to log now for `message` of kind `key` (the message, or nothing when a line of the
  // key was logged less than window_s ago: then it is counted for the summary).
  std::optional<std::string> admit(const std::string& key, const std::string& message);
  // The summaries of windows that have passed with lines held back: the last such message
  // with " (N more like this in the last W s)", one per key; forgets the keys whose window
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

  const double window_s_;
  const std::function<Clock::time_point()> now_;
  const size_t max_keys_;
  mutable std::mutex mu_;
  std::map<std::string, Window> windows_;
};

}  // namespace spes::sync
