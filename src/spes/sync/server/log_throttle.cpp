// One log line per key and window, then a count of the rest (see log_throttle.h).
#include "spes/sync/server/log_throttle.h"

#include <fmt/core.h>

#include <algorithm>

namespace spes::sync {

namespace {
const char* kOverflowKey = "\x01(other sources)";
}  // namespace

LogThrottle::LogThrottle(double window_s, std::function<Clock::time_point()> now,
                         size_t max_keys, uint64_t max_lines)
    : window_s_(window_s), now_(std::move(now)), max_keys_(std::max<size_t>(max_keys, 1)),
      max_lines_(std::max<uint64_t>(max_lines, 1)) {}

bool LogThrottle::take_total(Clock::time_point now, const std::string& message) {
  if (!total_started_ ||
      std::chrono::duration<double>(now - total_.start).count() >= window_s_) {
    // A new total window; lines held back in the last one stay counted until flush().
    total_.start = now;
    total_lines_ = 0;
    total_started_ = true;
  }
  if (total_lines_ < max_lines_) {
    ++total_lines_;
    return true;
  }
  if (total_.held++ == 0) held_since_ = now;
  total_.last = message;
  return false;
}

std::string LogThrottle::summary(const Window& w) const {
  return fmt::format("{} ({} more like this in the last {:g} s)", w.last, w.held, window_s_);
}

std::optional<std::string> LogThrottle::admit(const std::string& key,
                                              const std::string& message) {
  const auto now = now_();
  std::lock_guard<std::mutex> lk(mu_);
  auto it = windows_.find(key);
  if (it == windows_.end() && windows_.size() >= max_keys_) it = windows_.find(kOverflowKey);
  if (it != windows_.end() &&
      std::chrono::duration<double>(now - it->second.start).count() < window_s_) {
    ++it->second.held;
    it->second.last = message;
    return std::nullopt;
  }
  // A new window: its first line is logged (with the count of the previous window's held-back
  // lines when flush() has not reported them yet), if the total cap lets it.
  if (!take_total(now, message)) return std::nullopt;
  std::string line = message;
  if (it != windows_.end() && it->second.held > 0)
    line += fmt::format(" ({} more like this before it)", it->second.held);
  const std::string k = it != windows_.end()         ? it->first
                        : windows_.size() >= max_keys_ ? std::string(kOverflowKey)
                                                       : key;
  windows_[k] = Window{now, 0, {}};
  return line;
}

std::vector<std::string> LogThrottle::flush() {
  const auto now = now_();
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<std::string> out;
  for (auto it = windows_.begin(); it != windows_.end();) {
    if (std::chrono::duration<double>(now - it->second.start).count() < window_s_) {
      ++it;
      continue;
    }
    if (it->second.held > 0 && take_total(now, summary(it->second)))
      out.push_back(summary(it->second));
    it = windows_.erase(it);
  }
  // One line for the lines the cap held back, once a window has passed since the first.
  if (total_.held > 0 && std::chrono::duration<double>(now - held_since_).count() >= window_s_) {
    out.push_back(fmt::format("log cap: {} more lines of refused calls were not logged over the "
                              "last {:.0f} s (at most {} such lines every {:g} s); the last: {}",
                              total_.held, std::chrono::duration<double>(now - held_since_).count(),
                              max_lines_, window_s_, total_.last));
    total_.held = 0;
  }
  return out;
}

size_t LogThrottle::keys() const {
  std::lock_guard<std::mutex> lk(mu_);
  return windows_.size();
}

}  // namespace spes::sync
