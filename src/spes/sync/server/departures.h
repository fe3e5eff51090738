// Which nodes the sync server counts as departed, and what it measures to share their experts
// (docs/PROTOCOL.md, "Ownership epochs"). A node is declared departed when it leaves
// "departing", or when it missed spes_config.reassign_after_rounds consecutive published rounds
// (0: never) without having left "finished"; a departed node that joins again is live again (it
// owns only what the map gives it), and so is one declared departed for its misses whose upload
// a round uses. A node that left "departing" stays departed when the round it left in uses the
// upload it sent before leaving (that round has its experts' last training; the next map moves
// them). Per node: its delivered tokens/s over its last
// kRateRounds uploads (tokens / seconds from the previous publication to its upload's arrival:
// what the server itself saw) and the capacity it declared on Join. Not thread-safe:
// RoundState's lock guards it. Leaves out: the share rule (round/reassign.h) and the map.
#pragma once
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "spes/sync/round/reassign.h"

namespace spes::sync {

class Departures {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr size_t kRateRounds = 8;
  Departures(size_t num_nodes, int64_t reassign_after_rounds);

  // `capacity`: the experts per layer it declared (0: no cap); `memory_experts`: those its
  // declared memory holds (-1: not declared).
  void joined(int64_t node, int64_t capacity, int64_t memory_experts = -1);
  void left(int64_t node, bool departing, int64_t round);
  // Node's upload for the collecting round arrived (its time, for the node's rate).
  void upload_arrived(int64_t node, Clock::time_point at);
  // Round `round` was published at `at` with the uploads of `nodes` (tokens each): counts the
  // misses of the others that take part (`takes_part`, per node id: not a vacant arrival id)
  // and declares those past the limit departed (logged). Returns the nodes declared departed
  // by this round.
  std::vector<int64_t> round_published(int64_t round, const std::vector<int64_t>& nodes,
                                       const std::vector<int64_t>& tokens, Clock::time_point at,
                                       const std::vector<bool>& takes_part);
  // Departed nodes -> why.
  const std::map<int64_t, std::string>& departed() const { return departed_; }
  bool is_departed(int64_t node) const { return departed_.count(node) > 0; }
  // A node that joined again after it was declared departed (issue 38 item 6: it joins as a new
  // node would; the share rule treats it as an arrival while it owns no expert).
  bool returned(int64_t node) const { return returned_.count(node) > 0; }
  // `live` nodes with their rates and capacities for the share rule.
  std::vector<LiveNode> live_nodes(const std::vector<int64_t>& live) const;
  double rate(int64_t node) const;
  // Saved with each round (the drift state) so a restarted server keeps counting.
  nlohmann::json to_json() const;
  bool restore(const nlohmann::json& j);

 private:
  struct Node {
    int64_t misses = 0;
    bool finished = false;
    bool left_for_good = false;  // left "departing" (not undone by its last upload)
    int64_t capacity = 0;
    int64_t memory_experts = -1;
    bool arrived = false;
    Clock::time_point arrived_at;
    std::deque<std::pair<double, double>> recent;  // (tokens, seconds) of its last uploads
  };
  int64_t limit_;
  std::vector<Node> nodes_;
  std::map<int64_t, std::string> departed_;
  std::set<int64_t> returned_;
  bool opened_ = false;
  Clock::time_point opened_at_;  // the previous publication (or the server's start)
};

}  // namespace spes::sync
