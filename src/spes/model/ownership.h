// Which node owns (trains) each expert: one map from (layer, expert) to node, validated once
// (every expert has exactly one owner in [0, num_nodes)). Epoch 0 is built from spes_config
// (from_config); later maps (issue 38: experts handed to other nodes, nodes arriving, so
// num_nodes may exceed spes_config.num_peers) arrive as tables (from_table). The server and
// every node compare fingerprints.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "spes/io/config.h"

namespace spes {

class Ownership {
 public:
  // Contiguous blocks by default (node i owns [i*m, (i+1)*m) in every layer, m = E/N, or
  // spes_config.num_train_experts_per_node, when nodes past E/m own none);
  // spes_config.expert_owners gives an explicit map (one row for all layers, or one per layer).
  static Ownership from_config(const Config& cfg);
  Ownership(int64_t num_nodes, std::vector<std::vector<int64_t>> owner);
  // A map received from elsewhere (a checkpoint, the wire): owner[layer][expert] -> node in
  // [0, num_nodes), every layer the same number of experts, num_nodes in [1, kMaxNodes];
  // throws naming `origin` and the problem otherwise.
  static Ownership from_table(int64_t num_nodes, std::vector<std::vector<int64_t>> owner,
                              const std::string& origin = "ownership map");
  static constexpr int64_t kMaxNodes = 1 << 16;

  int64_t num_nodes() const { return num_nodes_; }
  int64_t num_layers() const { return static_cast<int64_t>(owner_.size()); }
  int64_t num_experts() const { return owner_.empty() ? 0 : static_cast<int64_t>(owner_[0].size()); }
  int64_t owner(int64_t layer, int64_t expert) const { return owner_.at(layer).at(expert); }
  // Experts of `layer` owned by `node`, ascending.
  std::vector<int64_t> experts_of(int64_t node, int64_t layer) const;
  const std::vector<std::vector<int64_t>>& table() const { return owner_; }
  // Stable digest of the map, compared between server and nodes.
  std::string fingerprint() const;
  // Throws (naming `origin`) unless the map covers `layers` x `experts` (a model's MoE layers).
  void check_shape(int64_t layers, int64_t experts, const std::string& origin) const;
  bool operator==(const Ownership& o) const {
    return num_nodes_ == o.num_nodes_ && owner_ == o.owner_;
  }
  bool operator!=(const Ownership& o) const { return !(*this == o); }

 private:
  int64_t num_nodes_;
  std::vector<std::vector<int64_t>> owner_;  // [layer][expert] -> node
};

}  // namespace spes
