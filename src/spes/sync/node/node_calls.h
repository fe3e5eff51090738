// How a SPES node's calls to the sync server are retried (SyncNode::call, node.h): transient
// failures (unavailable, data loss, aborted, deadline) again after a pause that doubles from
// 0.2 s up to spes_config.retry_backoff_max_s (an unreachable server: as soon as the channel
// connects again, at the latest after that pause), until `limit_s` has passed; a server that no
// longer knows the node (it restarted) is joined again, up to 5 times per call; a node that is
// stopping makes no new attempt, and a stop requested by a signal ends the retries
// (NodeStopped). Included by the .cpp files that define SyncNode's members.
#pragma once
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "spes/common/stop_signal.h"
#include "spes/sync/node/client.h"
#include "spes/sync/node/node.h"

namespace spes::sync {
namespace node_detail {

using Clock = std::chrono::steady_clock;

inline double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

inline bool retryable(SyncErrc c) {
  return c == SyncErrc::Unavailable || c == SyncErrc::DataLoss || c == SyncErrc::Aborted ||
         c == SyncErrc::DeadlineExceeded;
}

}  // namespace node_detail

template <class F>
auto SyncNode::call(const char* what, double limit_s, F&& f) -> decltype(f()) {
  const auto start = node_detail::Clock::now();
  double backoff = 0.2;
  const double max_backoff = trainer_->config().spes_config.transport.retry_backoff_max_s;
  int rejoins = 0;
  for (int attempt = 1;; ++attempt) {
    if (stopping_) fail("node {}: {}: the node is stopping", client_->id().node_id, what);
    try {
      return f();
    } catch (const SyncError& e) {
      if (e.code() == SyncErrc::NotJoined && rejoins < 5) {
        // The server restarted (or forgot us): join again with the same incarnation, then
        // repeat the call; the round logic (round ids) decides what still applies.
        ++rejoins;
        spdlog::warn("node {}: {}: the server does not know this node (restarted?); joining "
                     "again", client_->id().node_id, what);
        rejoin(limit_s);
        continue;
      }
      if (!node_detail::retryable(e.code()) || node_detail::since(start) + backoff > limit_s) throw;
      if (stop_signal() != 0)
        throw NodeStopped(fmt::format("node {}: {}: stopped by {} while the server was "
                                      "unreachable", client_->id().node_id, what,
                                      signal_name(stop_signal())));
      spdlog::warn("{} failed (attempt {}): {}; retrying in {:.1f} s", what, attempt, e.what(),
                   backoff);
      // A restarted server: as soon as it listens; a refusal: after the whole backoff.
      client_->wait_before_retry(backoff);
      backoff = std::min(max_backoff, backoff * 2);
    }
  }
}

}  // namespace spes::sync
