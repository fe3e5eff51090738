// The run's ownership epochs as the sync server keeps them (docs/PROTOCOL.md, "Ownership
// epochs"): epoch 0 is the config's map; each later one was decided by the server at a round's
// publication and applies from the next round on. All of them live in DIR/ownership.json,
// written atomically BEFORE the round that introduces an epoch is persisted and published, so
// a server killed at any moment and restarted on DIR continues with one consistent map: on
// restart the epochs that start after the collecting round (their round never got published)
// are dropped. Not thread-safe: RoundState's lock guards it. Leaves out: deciding a map
// (round/reassign.h) and applying it (SyncModel::change_ownership).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "spes/model/ownership.h"
#include "spes/sync/wire/protocol.h"

namespace spes::sync {

class OwnershipEpochs {
 public:
  // Epoch 0: `initial` (the config's map); later maps are for at most `max_nodes` nodes
  // (SpesConfig::node_slots). Nothing is read or written yet.
  OwnershipEpochs(std::string dir, const Ownership& initial, int64_t max_nodes);
  // The map of epoch `epoch` (one of this run's: 0 .. latest().epoch).
  const OwnershipMap& epoch(int64_t epoch) const { return epochs_.at(static_cast<size_t>(epoch)); }
  // A fresh run: ownership.json holds epoch 0 only (an earlier run's file is replaced).
  void start();
  // A restarted server at published round `published_round`: the epochs from ownership.json
  // that start at or before the collecting round (none: epoch 0, logged when the file is
  // missing). Throws with the fix when the file is damaged or its epoch 0 is not the config's.
  void resume(int64_t published_round);
  // The map of round `round` (the latest epoch starting at or before it).
  const OwnershipMap& at_round(int64_t round) const;
  const OwnershipMap& latest() const { return epochs_.back(); }
  // Appends `next` (epoch latest + 1, from_round after the latest's) with the handoffs that made
  // it and saves the file (throws, nothing changed, when it cannot be written). `next` may
  // replace an epoch that starts at the same round and was never published (a retried save).
  void introduce(const OwnershipMap& next, const nlohmann::json& handoffs);
  // The handoffs that made epoch `epoch` ([] for epoch 0 or an epoch not decided).
  nlohmann::json handoffs(int64_t epoch) const;
  // Whether the node's (epoch, fingerprint) is one of this run's epochs ("" : the config's).
  bool knows(int64_t epoch, const std::string& fingerprint) const;
  std::string path() const;

 private:
  void save() const;
  std::string dir_;
  int64_t max_nodes_;
  std::vector<OwnershipMap> epochs_;          // ascending epoch, from_round
  std::vector<nlohmann::json> handoffs_;      // per epoch: what moved (epoch 0: [])
};

}  // namespace spes::sync
