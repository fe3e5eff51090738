// The share rule for a departed node's experts (see reassign.h).
#include "spes/sync/round/reassign.h"

#include <algorithm>
#include <cmath>

namespace spes::sync {

int64_t LiveNode::max_experts() const {
  if (memory_experts < 0) return capacity > 0 ? capacity : -1;
  return capacity > 0 ? std::min(capacity, memory_experts) : memory_experts;
}

namespace {
// Unknown rates (<= 0, NaN) replaced by the median of the known ones (1 when none is known).
std::vector<double> effective_rates(const std::vector<LiveNode>& live) {
  std::vector<double> known;
  for (const LiveNode& n : live)
    if (std::isfinite(n.rate) && n.rate > 0) known.push_back(n.rate);
  double fill = 1.0;
  if (!known.empty()) {
    std::sort(known.begin(), known.end());
    const size_t k = known.size();
    fill = k % 2 ? known[k / 2] : 0.5 * (known[k / 2 - 1] + known[k / 2]);
  }
  std::vector<double> out;
  for (const LiveNode& n : live)
    out.push_back(std::isfinite(n.rate) && n.rate > 0 ? n.rate : fill);
  return out;
}

// One layer: its departed nodes' experts to the live nodes (reassign.h's rule).
void reassign_layer(int64_t layer, std::vector<int64_t>& row,
                    const std::map<int64_t, std::string>& departed,
                    const std::vector<LiveNode>& live, const std::vector<double>& rate,
                    Reassignment& out) {
  std::vector<int64_t> load(live.size(), 0);
  std::vector<int64_t> orphans;
  for (size_t e = 0; e < row.size(); ++e) {
    if (departed.count(row[e])) {
      orphans.push_back(static_cast<int64_t>(e));
      continue;
    }
    for (size_t i = 0; i < live.size(); ++i)
      if (live[i].node == row[e]) ++load[i];
  }
  if (orphans.empty()) return;
  double total_rate = 0;
  int64_t total = static_cast<int64_t>(orphans.size());
  for (size_t i = 0; i < live.size(); ++i) {
    total_rate += rate[i];
    total += load[i];
  }
  for (int64_t e : orphans) {
    int best = -1;
    double best_deficit = 0;
    for (size_t i = 0; i < live.size(); ++i) {
      const int64_t cap = live[i].max_experts();
      if (cap >= 0 && load[i] >= cap) continue;
      const double deficit = static_cast<double>(total) * rate[i] / total_rate -
                             static_cast<double>(load[i]);
      if (best < 0 || deficit > best_deficit) {  // ties: the lower node (live is ascending)
        best = static_cast<int>(i);
        best_deficit = deficit;
      }
    }
    if (best < 0) {
      out.frozen.emplace_back(layer, e);
      continue;
    }
    const int64_t from = row[static_cast<size_t>(e)];
    row[static_cast<size_t>(e)] = live[static_cast<size_t>(best)].node;
    ++load[static_cast<size_t>(best)];
    out.handoffs.push_back({layer, e, from, live[static_cast<size_t>(best)].node, departed.at(from)});
  }
}
// One layer of give_to_arrivals (its rule in reassign.h).
void arrivals_layer(int64_t layer, std::vector<int64_t>& row, const std::vector<bool>& arriving,
                    const std::vector<LiveNode>& live, const std::vector<double>& rate,
                    Reassignment& out) {
  std::vector<int64_t> load(live.size(), 0);
  for (int64_t owner : row)
    for (size_t i = 0; i < live.size(); ++i)
      if (live[i].node == owner) ++load[i];
  double total_rate = 0;
  int64_t total = 0;
  for (size_t i = 0; i < live.size(); ++i) {
    total_rate += rate[i];
    total += load[i];
  }
  auto deficit = [&](size_t i) {
    return static_cast<double>(total) * rate[i] / total_rate - static_cast<double>(load[i]);
  };
  for (;;) {
    int to = -1, from = -1;
    for (size_t i = 0; i < live.size(); ++i) {
      if (!arriving[i] || (live[i].capacity > 0 && load[i] >= live[i].capacity)) continue;
      if (load[i] > 0 && deficit(i) < 0.5) continue;
      if (to < 0 || deficit(i) > deficit(static_cast<size_t>(to))) to = static_cast<int>(i);
    }
    for (size_t i = 0; i < live.size(); ++i) {
      if (arriving[i] || load[i] < 2) continue;
      if (from < 0 || deficit(i) < deficit(static_cast<size_t>(from))) from = static_cast<int>(i);
    }
    if (to < 0 || from < 0) return;
    const int64_t donor = live[static_cast<size_t>(from)].node;
    int64_t e = static_cast<int64_t>(row.size()) - 1;
    while (row[static_cast<size_t>(e)] != donor) --e;
    row[static_cast<size_t>(e)] = live[static_cast<size_t>(to)].node;
    --load[static_cast<size_t>(from)];
    ++load[static_cast<size_t>(to)];
    out.handoffs.push_back({layer, e, donor, live[static_cast<size_t>(to)].node, kArrivalWhy});
  }
}
}  // namespace

Reassignment give_to_arrivals(std::vector<std::vector<int64_t>> table,
                              const std::vector<int64_t>& arrivals,
                              const std::vector<LiveNode>& live_in) {
  std::vector<LiveNode> live = live_in;
  std::sort(live.begin(), live.end(),
            [](const LiveNode& a, const LiveNode& b) { return a.node < b.node; });
  std::vector<bool> arriving(live.size());
  for (size_t i = 0; i < live.size(); ++i)
    arriving[i] = std::find(arrivals.begin(), arrivals.end(), live[i].node) != arrivals.end();
  Reassignment out;
  out.table = std::move(table);
  if (arrivals.empty() || live.empty()) return out;
  const std::vector<double> rate = effective_rates(live);
  for (size_t l = 0; l < out.table.size(); ++l)
    arrivals_layer(static_cast<int64_t>(l), out.table[l], arriving, live, rate, out);
  return out;
}

Reassignment reassign_experts(const Ownership& current,
                              const std::map<int64_t, std::string>& departed,
                              const std::vector<LiveNode>& live_in) {
  std::vector<LiveNode> live = live_in;
  std::sort(live.begin(), live.end(),
            [](const LiveNode& a, const LiveNode& b) { return a.node < b.node; });
  Reassignment out;
  out.table = current.table();
  const std::vector<double> rate = effective_rates(live);
  for (size_t l = 0; l < out.table.size(); ++l)
    reassign_layer(static_cast<int64_t>(l), out.table[l], departed, live, rate, out);
  return out;
}

}  // namespace spes::sync
