// Per-caller call rates of the sync server, without gRPC: a token bucket per (caller, RPC) that
// refills at `per_s` calls a second up to `burst`. A call past its bucket is refused (the
// server answers UNAVAILABLE, naming the limit, so an honest node retries after its backoff);
// it costs the server no lock of the round state and no log line beyond the throttled one.
// The caller is the node its credentials prove (never a node id a call merely claims), or the
// peer's host for read access (Status). Holds at most `max_keys` buckets: buckets that have
// refilled (idle callers) are dropped first, and when every bucket is in use a flood of new
// callers shares one overflow bucket. The clock is injected for tests. Thread-safe.
// Leaves out: concurrent calls (stream_limits.h, long_poll_limits.h, the thread cap), what a
// call may carry (call_auth.h, RoundState).
#pragma once
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <string>

namespace spes::sync {

struct CallRate {
  double per_s = 0;  // sustained calls a second
  double burst = 0;  // calls allowed at once after an idle spell
};

class CallRates {
 public:
  using Clock = std::chrono::steady_clock;
  // `rates`: per RPC name; an RPC without an entry is not limited.
  explicit CallRates(std::map<std::string, CallRate> rates,
                     std::function<Clock::time_point()> now = Clock::now,
                     size_t max_keys = 4096);

  // Takes one call of `rpc` by `caller` from its bucket; false when the bucket is empty.
  bool admit(const std::string& caller, const std::string& rpc);
  // The limit of `rpc` (per_s 0 when unlimited).
  CallRate rate(const std::string& rpc) const;
  size_t keys() const;

 private:
  struct Bucket {
    double tokens = 0;
    Clock::time_point at;
  };
  double refilled(const Bucket& b, const CallRate& r, Clock::time_point now) const;

  const std::map<std::string, CallRate> rates_;
  const std::function<Clock::time_point()> now_;
  const size_t max_keys_;
  mutable std::mutex mu_;
  std::map<std::string, Bucket> buckets_;  // key: rpc + '\n' + caller
};

}  // namespace spes::sync
