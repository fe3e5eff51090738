// At most a few long-polls per node; a newer one ends the oldest (see long_poll_limits.h).
#include "spes/sync/server/long_poll_limits.h"

#include <algorithm>

namespace spes::sync {

LongPollLimits::LongPollLimits(size_t per_node) : per_node_(std::max<size_t>(per_node, 1)) {}

LongPollLimits::Lease::Lease(LongPollLimits& owner, int64_t node,
                             std::function<void()> end_early)
    : owner_(owner), node_(node), end_early_(std::move(end_early)) {}

LongPollLimits::Lease::~Lease() {
  std::lock_guard<std::mutex> lk(owner_.mu_);
  --owner_.open_;
  auto it = owner_.running_.find(node_);
  if (it == owner_.running_.end()) return;
  auto& q = it->second;
  q.erase(std::remove(q.begin(), q.end(), this), q.end());
  if (q.empty()) owner_.running_.erase(it);
}

std::unique_ptr<LongPollLimits::Lease> LongPollLimits::open(int64_t node,
                                                            std::function<void()> end_early) {
  std::unique_ptr<Lease> lease(new Lease(*this, node, std::move(end_early)));
  std::lock_guard<std::mutex> lk(mu_);
  auto& q = running_[node];
  while (q.size() >= per_node_) {  // the oldest ends now (under the lock: it is alive)
    Lease* oldest = q.front();
    q.pop_front();
    oldest->ended_ = true;
    oldest->end_early_();
  }
  q.push_back(lease.get());
  ++open_;
  return lease;
}

size_t LongPollLimits::open_polls() const {
  std::lock_guard<std::mutex> lk(mu_);
  return open_;
}

}  // namespace spes::sync
