// Expert ownership map (see ownership.h).
#include "spes/model/ownership.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "spes/common/error.h"
#include "spes/io/files.h"

namespace spes {

Ownership::Ownership(int64_t num_nodes, std::vector<std::vector<int64_t>> owner)
    : num_nodes_(num_nodes), owner_(std::move(owner)) {
  SPES_CHECK(num_nodes_ >= 1, "ownership: number of nodes must be >= 1, found {}", num_nodes_);
  for (size_t l = 0; l < owner_.size(); ++l) {
    SPES_CHECK(owner_[l].size() == owner_[0].size(),
               "ownership: layer {} lists {} experts but layer 0 lists {}", l, owner_[l].size(),
               owner_[0].size());
    for (size_t e = 0; e < owner_[l].size(); ++e)
      SPES_CHECK(owner_[l][e] >= 0 && owner_[l][e] < num_nodes_,
                 "ownership: expert {} of layer {} is owned by node {}, outside [0, {})", e, l,
                 owner_[l][e], num_nodes_);
  }
}

Ownership Ownership::from_table(int64_t num_nodes, std::vector<std::vector<int64_t>> owner,
                                const std::string& origin) {
  SPES_CHECK(num_nodes >= 1 && num_nodes <= kMaxNodes,
             "{}: the number of nodes must be in [1, {}], found {}", origin, kMaxNodes, num_nodes);
  for (size_t l = 0; l < owner.size(); ++l) {
    SPES_CHECK(owner[l].size() == owner[0].size(),
               "{}: layer {} lists {} experts but layer 0 lists {} (every layer needs one owner "
               "per expert)", origin, l, owner[l].size(), owner[0].size());
    for (size_t e = 0; e < owner[l].size(); ++e)
      SPES_CHECK(owner[l][e] >= 0 && owner[l][e] < num_nodes,
                 "{}: expert {} of layer {} is owned by node {}, outside [0, {})", origin, e, l,
                 owner[l][e], num_nodes);
  }
  return Ownership(num_nodes, std::move(owner));
}

void Ownership::check_shape(int64_t layers, int64_t experts, const std::string& origin) const {
  SPES_CHECK(num_layers() == layers && (layers == 0 || num_experts() == experts),
             "{}: the ownership map covers {} layers x {} experts but the model has {} x {} (a "
             "map of another model)", origin, num_layers(), num_experts(), layers, experts);
}

Ownership Ownership::from_config(const Config& cfg) {
  const auto& s = cfg.spes_config;
  const int64_t L = cfg.model.n_layers, E = cfg.model.is_moe() ? cfg.model.moe_num_experts : 0;
  const int64_t N = s.num_peers;
  std::vector<std::vector<int64_t>> owner;
  if (!s.expert_owners.empty()) {
    SPES_CHECK(s.expert_owners.size() == 1 || static_cast<int64_t>(s.expert_owners.size()) == L,
               "spes_config.expert_owners: expected 1 row (all layers) or {} rows (one per "
               "layer), found {}", L, s.expert_owners.size());
    for (int64_t l = 0; l < L; ++l) {
      const auto& row = s.expert_owners[s.expert_owners.size() == 1 ? 0 : l];
      SPES_CHECK(static_cast<int64_t>(row.size()) == E,
                 "spes_config.expert_owners: row for layer {} has {} entries, expected one "
                 "owner per expert ({})", l, row.size(), E);
      owner.push_back(row);
    }
    return Ownership(N, owner);
  }
  if (E == 0) return Ownership(N, std::vector<std::vector<int64_t>>(L));
  std::vector<int64_t> row(E);
  if (s.num_train_experts_per_node > 0) {
    // The reference's rule: expert e belongs to node e / m, m experts per owning node; with
    // m x num_peers > E the nodes from E / m on own none and train only the shared tensors (its
    // 9B run: 8 nodes, m = 2, 8 experts: nodes 4-7 own none).
    const int64_t m = s.num_train_experts_per_node;
    SPES_CHECK(E % m == 0 && E / m <= N,
               "spes_config.num_train_experts_per_node={} gives expert e to node e / {}, which "
               "needs moe_num_experts={} to be a multiple of it and at most num_peers={} blocks "
               "of it (so every expert has one owner); set spes_config.expert_owners for an "
               "uneven map", m, m, E, N);
    for (int64_t e = 0; e < E; ++e) row[e] = e / m;
  } else {
    SPES_CHECK(E % N == 0 || s.mode != SyncMode::Spes,
               "spes_config: {} experts cannot be split evenly over num_peers={} nodes; set "
               "spes_config.expert_owners to give an explicit (uneven) map", E, N);
    const int64_t m = std::max<int64_t>(1, E / N);
    for (int64_t e = 0; e < E; ++e) row[e] = std::min<int64_t>(e / m, N - 1);
  }
  owner.assign(L, row);
  return Ownership(N, owner);
}

std::vector<int64_t> Ownership::experts_of(int64_t node, int64_t layer) const {
  std::vector<int64_t> out;
  for (int64_t e = 0; e < num_experts(); ++e)
    if (owner_.at(layer)[e] == node) out.push_back(e);
  return out;
}

std::string Ownership::fingerprint() const {
  std::string s = fmt::format("nodes={};", num_nodes_);
  for (const auto& row : owner_) s += fmt::format("{};", fmt::join(row, ","));
  return sha256_hex(s).substr(0, 16);
}

}  // namespace spes
