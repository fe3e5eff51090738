// Who takes part in the run, as the sync server sees it: each node's join (its protocol version
// and the settings it must share with the server, sync/round/join_settings.h), incarnation,
// last reported step, its heartbeats (last loss, throughput and a bounded loss curve), leaving, and whether it is dead
// (joined, not left, and silent for longer than spes_config.heartbeat_timeout).
// Not thread-safe: RoundState's lock guards it. Leaves out: uploads and rounds, and credentials:
// the transport checks a node's token before a call reaches the server's state (call_auth.h);
// here a node id is only checked to be one of the run's.
#pragma once
#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "spes/io/config.h"
#include "spes/sync/round/aggregate.h"
#include "spes/sync/server/loss_history.h"
#include "spes/sync/wire/protocol.h"

namespace spes::sync {

struct Member {
  bool joined = false, left = false;
  uint64_t incarnation = 0;
  int64_t step = 0;  // last step the node reported
  bool seen = false;
  std::chrono::steady_clock::time_point last_seen;
  bool dead_logged = false;
  double loss = NAN, tokens_per_s = NAN;  // from its last heartbeat
  LossHistory losses;
};

class Membership {
 public:
  Membership(const Config& cfg, const SyncModel& model);
  size_t size() const { return members_.size(); }
  const Member& operator[](size_t node) const { return members_[node]; }

  // Throws PermissionDenied for a node id outside the run.
  void check_id(const NodeId& node) const;
  // check_id, and the node must have joined with this incarnation (NotJoined otherwise);
  // marks it seen.
  void check(const NodeId& node);
  // Checks the node's protocol version and settings against the server's and records it as
  // joined at info.step. Returns true when it comes with another incarnation than before (a
  // restarted node, or its first join).
  bool join(const JoinInfo& info);
  void set_step(int64_t node, int64_t step) { members_[node].step = step; }
  void leave(int64_t node, int64_t step);
  void heartbeat(int64_t node, int64_t step, const NodeMetrics& metrics);

  bool is_dead(size_t node) const;
  // Logs each node that became dead (once per silence).
  void log_dead();
  // The interval the server asks heartbeats at: a quarter of the timeout, 0.1 to 5 s.
  uint32_t heartbeat_interval_ms() const;
  std::vector<std::vector<LossPoint>> loss_history() const;

 private:
  const Config& cfg_;
  std::map<std::string, std::string> server_settings_;  // join_settings.h: what joins must match
  std::vector<Member> members_;
};

}  // namespace spes::sync
