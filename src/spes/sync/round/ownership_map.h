// An ownership epoch's map (wire/protocol.h OwnershipMap) made from an Ownership, checked
// and turned back into one (its fingerprint must match what it lists, its shape the model's),
// and written to / read from JSON (the server's ownership.json, and the map of one round in it,
// for offline replays). Leaves out: who decides a new map (reassign.h, server/ownership_epochs.h)
// and the wire message (wire/ownership_message.h).
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "spes/model/ownership.h"
#include "spes/sync/wire/protocol.h"

namespace spes::sync {

OwnershipMap ownership_map(const Ownership& o, int64_t epoch, int64_t from_round);
// The Ownership `m` lists, after checking it: `layers` x `experts` entries, owners in
// [0, m.num_nodes), m.num_nodes in [1, `num_nodes`] (the run's node ids, SpesConfig::node_slots:
// epoch 0 is for num_peers nodes, a later epoch may give experts to arrivals), and the fingerprint of what it lists equal to
// m.fingerprint. Throws SyncError(InvalidArgument) naming `origin` and what differs.
Ownership ownership_of(const OwnershipMap& m, int64_t num_nodes, int64_t layers,
                       int64_t experts, const std::string& origin);
nlohmann::json ownership_map_json(const OwnershipMap& m);
OwnershipMap ownership_map_from_json(const nlohmann::json& j);

// The format of the server's ownership.json: {"format", "epochs": [{"map", "handoffs"}, ...]}.
inline constexpr const char* kOwnershipFileFormat = "spes-ownership-v1";
// The map of round `round` in an ownership.json document `doc`: the latest epoch that starts
// at or before it (every map checked: shape `layers` x `experts`, fingerprint). Throws naming
// `origin` when the document is not an ownership.json or a map is damaged.
OwnershipMap ownership_map_at_round(const nlohmann::json& doc, int64_t round, int64_t layers,
                                    int64_t experts, const std::string& origin);
// The run's ownership.json at `path` read and checked against the run's first map `initial`
// (epoch 0 must be it: a file of another run is refused), then the map of `round` and its
// Ownership: what an offline replay of a round aggregates under (`spes aggregate --ownership`,
// `spes launch`'s re-check of kept rounds).
std::pair<OwnershipMap, Ownership> round_ownership_from_file(const std::string& path,
                                                             const Ownership& initial,
                                                             int64_t round);

}  // namespace spes::sync
