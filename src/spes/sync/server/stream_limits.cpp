// One stream per node and kind, and the idle-stream watchdog (see stream_limits.h).
#include "spes/sync/server/stream_limits.h"

namespace spes::sync {

using Clock = std::chrono::steady_clock;

StreamLimits::StreamLimits(double first_message_s, double idle_s)
    : first_message_(first_message_s), idle_(idle_s) {
  watchdog_ = std::thread([this] { watch(); });
}

StreamLimits::~StreamLimits() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  watchdog_.join();
}

StreamLimits::Lease::Lease(StreamLimits& owner, int64_t node, StreamKind kind,
                           std::function<void()> cancel)
    : owner_(owner), node_(node), kind_(kind), cancel_(std::move(cancel)) {}

StreamLimits::Lease::~Lease() {
  std::lock_guard<std::mutex> lk(owner_.mu_);
  owner_.leases_.erase(this);
  auto it = owner_.slots_.find({node_, static_cast<int>(kind_)});
  if (it != owner_.slots_.end() && it->second == this) owner_.slots_.erase(it);
}

void StreamLimits::Lease::waiting() {
  std::lock_guard<std::mutex> lk(owner_.mu_);
  waiting_ = true;
  since_ = Clock::now();
}

void StreamLimits::Lease::received() {
  std::lock_guard<std::mutex> lk(owner_.mu_);
  waiting_ = false;
  got_first_ = true;
}

std::unique_ptr<StreamLimits::Lease> StreamLimits::open(int64_t node, StreamKind kind,
                                                        std::function<void()> cancel) {
  std::unique_ptr<Lease> lease(new Lease(*this, node, kind, std::move(cancel)));
  std::lock_guard<std::mutex> lk(mu_);
  Lease*& slot = slots_[{node, static_cast<int>(kind)}];
  if (slot) {  // the older stream is still open: it ends now (under the lock: it is alive)
    slot->superseded_ = true;
    slot->cancel_();
  }
  slot = lease.get();
  leases_.insert(lease.get());
  return lease;
}

size_t StreamLimits::open_streams() const {
  std::lock_guard<std::mutex> lk(mu_);
  return leases_.size();
}

void StreamLimits::watch() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!stopping_) {
    cv_.wait_for(lk, std::chrono::milliseconds(100));
    const auto now = Clock::now();
    for (Lease* lease : leases_) {
      if (!lease->waiting_ || lease->timed_out_) continue;
      const auto limit = lease->got_first_ ? idle_ : first_message_;
      if (now - lease->since_ > limit) {
        lease->timed_out_ = true;
        lease->cancel_();
      }
    }
  }
}

}  // namespace spes::sync
