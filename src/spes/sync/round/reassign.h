// Who takes a departed node's experts (docs/PROTOCOL.md, "Ownership epochs"): the server's
// share rule, a pure function of the current map, the departed nodes and the live nodes'
// measured rates and declared capacities. Per layer, separately: the experts of departed nodes
// (ascending) go one by one to the live node furthest below its proportional share of the
// layer, share_i = (experts the live nodes own + the departed ones) x rate_i / sum of rates,
// skipping nodes at their declared capacity (experts per layer); ties go to the lower node id.
// An expert no live node can take keeps its departed owner: it stays frozen (listed in
// `frozen`). Experts of live nodes never move. Leaves out: measuring rates, declaring
// departures, persisting the result (server/).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "spes/model/ownership.h"

namespace spes::sync {

struct LiveNode {
  int64_t node = 0;
  double rate = 0;         // delivered tokens/s over recent rounds (<= 0 or NaN: unknown)
  int64_t capacity = 0;    // experts per layer it declared it can train (0: no cap)
  // Experts per layer its declared memory holds (the server's estimate; -1: not declared).
  int64_t memory_experts = -1;
  // The most experts per layer it may own: the smaller of the two (-1: no cap).
  int64_t max_experts() const;
};

struct Handoff {
  int64_t layer = 0, expert = 0, from = 0, to = 0;
  std::string why;  // why `from` gave it up
};

struct Reassignment {
  std::vector<std::vector<int64_t>> table;                // [layer][expert] -> node
  std::vector<Handoff> handoffs;                          // layer, then expert order
  std::vector<std::pair<int64_t, int64_t>> frozen;        // (layer, expert) nobody could take
  bool changed() const { return !handoffs.empty(); }
};

// `departed`: node -> why it was declared departed. A node with an unknown rate counts at the
// median of the known rates (1 when none is known).
Reassignment reassign_experts(const Ownership& current, const std::map<int64_t, std::string>& departed,
                              const std::vector<LiveNode>& live);

// Arrivals (issue 38 item 6): `arrivals` (live nodes that own no expert yet: new ids, or
// departed ids that came back) take experts from the most loaded live nodes. Per layer,
// separately: share_i = (experts the live nodes own) x rate_i / sum of the live nodes' rates
// (an arrival's rate is unknown: the median of the others, as in reassign_experts); while an
// arrival owns none, or is at least half an expert below its share, the arrival furthest below
// its share (ties: lower id; at its capacity: skipped) takes the highest-numbered expert of the
// non-arriving live node furthest above its share that owns at least two (ties: lower id): a
// donor always keeps one. Handoffs say why = "arrival". Applied to `table` (the map after the
// departures' handoffs); experts of nodes that are not live never move.
Reassignment give_to_arrivals(std::vector<std::vector<int64_t>> table,
                              const std::vector<int64_t>& arrivals,
                              const std::vector<LiveNode>& live);
inline constexpr const char* kArrivalWhy = "arrival";

}  // namespace spes::sync
