// One log line per key and window, then a count of the rest (see log_throttle.h).
#include "spes/sync/server/log_throttle.h"

#include <fmt/core.h>

#include <algorithm>

namespace spes::sync {

namespace {
const char* kOverflowKey = "\x01(other sources)";
}  // namespace

LogThrottle::LogThrottle(double window_s, std::function<Clock::time_point()> now,
                         size_t max_keys)
    : window_s_(window_s), now_(std::move(now)), max_keys_(std::max<size_t>(max_keys, 1)) {}

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
  // lines when flush() has not reported them yet).
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
    if (it->second.held > 0) out.push_back(summary(it->second));
    it = windows_.erase(it);
  }
  return out;
}

size_t LogThrottle::keys() const {
  std::lock_guard<std::mutex> lk(mu_);
  return windows_.size();
}

}  // namespace spes::sync
