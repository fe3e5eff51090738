// Token buckets per caller and RPC (see call_rates.h).
#include "spes/sync/server/call_rates.h"

#include <algorithm>

namespace spes::sync {

namespace {
const char* kOverflowCaller = "\x01(other callers)";
}  // namespace

CallRates::CallRates(std::map<std::string, CallRate> rates,
                     std::function<Clock::time_point()> now, size_t max_keys)
    : rates_(std::move(rates)), now_(std::move(now)), max_keys_(std::max<size_t>(max_keys, 2)) {}

CallRate CallRates::rate(const std::string& rpc) const {
  const auto it = rates_.find(rpc);
  return it == rates_.end() ? CallRate{} : it->second;
}

double CallRates::refilled(const Bucket& b, const CallRate& r, Clock::time_point now) const {
  const double dt = std::max(0.0, std::chrono::duration<double>(now - b.at).count());
  return std::min(r.burst, b.tokens + dt * r.per_s);
}

bool CallRates::admit(const std::string& caller, const std::string& rpc) {
  const auto r = rates_.find(rpc);
  if (r == rates_.end() || r->second.per_s <= 0) return true;
  const auto now = now_();
  std::lock_guard<std::mutex> lk(mu_);
  std::string key = rpc + '\n' + caller;
  auto it = buckets_.find(key);
  if (it == buckets_.end() && buckets_.size() >= max_keys_) {
    // Forget the callers whose buckets are full again: a fresh bucket is the same.
    for (auto b = buckets_.begin(); b != buckets_.end();) {
      const std::string b_rpc = b->first.substr(0, b->first.find('\n'));
      if (refilled(b->second, rate(b_rpc), now) >= rate(b_rpc).burst) b = buckets_.erase(b);
      else ++b;
    }
    if (buckets_.size() >= max_keys_) key = rpc + '\n' + kOverflowCaller;
    it = buckets_.find(key);
  }
  if (it == buckets_.end()) it = buckets_.emplace(key, Bucket{r->second.burst, now}).first;
  Bucket& b = it->second;
  b.tokens = refilled(b, r->second, now);
  b.at = now;
  if (b.tokens < 1) return false;
  b.tokens -= 1;
  return true;
}

size_t CallRates::keys() const {
  std::lock_guard<std::mutex> lk(mu_);
  return buckets_.size();
}

}  // namespace spes::sync
