// A worker thread running queued jobs in order (see background_queue.h).
#include "spes/common/background_queue.h"

#include <spdlog/spdlog.h>

namespace spes {

BackgroundQueue::BackgroundQueue(std::string name)
    : name_(std::move(name)), thread_([this] { loop(); }) {}

BackgroundQueue::~BackgroundQueue() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void BackgroundQueue::post(std::string what, std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    jobs_.emplace_back(std::move(what), std::move(job));
    ++posted_;
  }
  cv_.notify_all();
}

uint64_t BackgroundQueue::wait() {
  std::unique_lock<std::mutex> lk(mu_);
  const uint64_t target = posted_;
  cv_.wait(lk, [&] { return done_ >= target; });
  return failed_;
}

void BackgroundQueue::loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    // Stops only once the queue is empty: what was posted before destruction still runs.
    cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;
    auto [what, job] = std::move(jobs_.front());
    jobs_.pop_front();
    lk.unlock();
    bool ok = true;
    try {
      job();
    } catch (const std::exception& e) {
      ok = false;
      spdlog::error("{}: {} failed: {}", name_, what, e.what());
    } catch (...) {
      ok = false;
      spdlog::error("{}: {} failed", name_, what);
    }
    lk.lock();
    ++done_;
    if (!ok) ++failed_;
    cv_.notify_all();
  }
}

}  // namespace spes
