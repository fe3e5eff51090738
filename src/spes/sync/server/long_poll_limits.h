// Limits on the sync server's long-polls (WaitRound, which may hold a server thread for up to
// 30 s), without gRPC: at most `per_node` open at once per node id. A newer long-poll of a node
// ends its oldest one early: that one answers at once with the round's state at that moment,
// as if its wait had run out (an honest node, which holds one at a time, simply asks again).
// Without node tokens (loopback only) anyone may claim any node id, so this also bounds a
// stranger's long-polls to per_node x num_peers. Leaves out: streams (stream_limits.h),
// credentials (call_auth.h), the wait itself (RoundState::wait_round).
#pragma once
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

namespace spes::sync {

class LongPollLimits {
 public:
  explicit LongPollLimits(size_t per_node = 2);
  LongPollLimits(const LongPollLimits&) = delete;
  LongPollLimits& operator=(const LongPollLimits&) = delete;

  // One open long-poll; releases its place when destroyed. Must not outlive the LongPollLimits
  // nor what `end_early` wakes.
  class Lease {
   public:
    ~Lease();
    // A newer long-poll of the node took this one's place: answer now.
    bool ended_early() const { return ended_; }

   private:
    friend class LongPollLimits;
    Lease(LongPollLimits& owner, int64_t node, std::function<void()> end_early);
    LongPollLimits& owner_;
    int64_t node_;
    std::function<void()> end_early_;
    std::atomic<bool> ended_{false};
  };

  // Registers a long-poll of `node` (already authenticated). When the node already has
  // per_node open, the oldest still running is marked ended_early() and its `end_early` is
  // called (it must wake that wait; it runs under this object's lock).
  std::unique_ptr<Lease> open(int64_t node, std::function<void()> end_early);
  size_t open_polls() const;

 private:
  const size_t per_node_;
  mutable std::mutex mu_;
  std::map<int64_t, std::deque<Lease*>> running_;  // per node, oldest first, not yet ended
  size_t open_ = 0;
};

}  // namespace spes::sync
