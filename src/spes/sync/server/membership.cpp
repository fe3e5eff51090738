// The run's nodes as the sync server sees them (see membership.h).
#include "spes/sync/server/membership.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "spes/common/strings.h"
#include "spes/common/timing.h"
#include "spes/sync/round/join_settings.h"

namespace spes::sync {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

Membership::Membership(const Config& cfg, const SyncModel& model)
    : cfg_(cfg),
      server_settings_(join_setting_values({cfg, model.model_fingerprint()})),
      members_(cfg.spes_config.node_slots()) {}

void Membership::check_id(const NodeId& node) const {
  if (node.node_id < 0 || node.node_id >= static_cast<int64_t>(members_.size()))
    sync_fail(SyncErrc::PermissionDenied, "node id {} is outside [0, max_nodes={}) (spes_config.max_nodes, or num_peers; an arriving node needs an id in [num_peers, max_nodes))",
              node.node_id, members_.size());
}

void Membership::check(const NodeId& node) {
  check_id(node);
  Member& m = members_[node.node_id];
  if (!m.joined || m.incarnation != node.incarnation)
    sync_fail(SyncErrc::NotJoined, "node {} (incarnation {:x}) has not joined this server "
              "(restarted node or restarted server?): join first", node.node_id,
              node.incarnation);
  m.seen = true;
  m.last_seen = Clock::now();
}

bool Membership::join(const JoinInfo& info) {
  const int64_t id = info.node.node_id;
  check_id(info.node);
  if (info.protocol_version != kProtocolVersion)
    sync_fail(SyncErrc::FailedPrecondition, "node {} speaks protocol version {}, this server "
              "speaks {}", id, info.protocol_version, kProtocolVersion);
  check_join_settings(id, info.settings, server_settings_);
  // A node at another step joins too: it decides from the reply whether to keep its weights
  // (checkpoint taken after the published round) or to take the published model.
  Member& m = members_[id];
  if (m.joined && m.incarnation != info.node.incarnation)
    spdlog::warn("node {} joined again with a new incarnation {:x} (was {:x})", id,
                 info.node.incarnation, m.incarnation);
  const bool new_incarnation = m.incarnation != info.node.incarnation;
  m.joined = true;
  m.left = false;
  m.incarnation = info.node.incarnation;
  m.step = info.step;
  m.seen = true;
  m.last_seen = Clock::now();
  return new_incarnation;
}

void Membership::leave(int64_t node, int64_t step) {
  members_[node].left = true;
  members_[node].step = step;
}

void Membership::heartbeat(int64_t node, int64_t step, const NodeMetrics& metrics) {
  Member& m = members_[node];
  m.step = step;
  if (std::isfinite(metrics.loss)) m.loss = metrics.loss;
  if (std::isfinite(metrics.tokens_per_s)) m.tokens_per_s = metrics.tokens_per_s;
  for (const LossPoint& p : metrics.losses) m.losses.add(p.step, p.loss);
}

bool Membership::is_dead(size_t node) const {
  const Member& m = members_[node];
  return m.joined && !m.left && m.seen &&
         seconds_since(m.last_seen) > cfg_.spes_config.timing.heartbeat_timeout;
}

void Membership::log_dead() {
  for (size_t i = 0; i < members_.size(); ++i) {
    const bool dead = is_dead(i);
    if (!dead) members_[i].dead_logged = false;
    if (dead && !members_[i].dead_logged) {
      members_[i].dead_logged = true;
      spdlog::warn("node {} is dead: nothing heard from it for {:.0f} s "
                   "(spes_config.heartbeat_timeout)", i, seconds_since(members_[i].last_seen));
    }
  }
}

uint32_t Membership::heartbeat_interval_ms() const {
  // A quarter of the timeout, and at most 5 s: heartbeats also carry the node's loss and
  // throughput for `spes status` and the dashboard.
  return static_cast<uint32_t>(
      std::clamp(cfg_.spes_config.timing.heartbeat_timeout * 1000 / 4, 100.0, 5000.0));
}

std::vector<std::vector<LossPoint>> Membership::loss_history() const {
  std::vector<std::vector<LossPoint>> out;
  for (const Member& m : members_) out.push_back(m.losses.points());
  return out;
}

}  // namespace spes::sync
