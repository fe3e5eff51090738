// Ownership epoch maps: made, checked, (de)serialised (see ownership_map.h).
#include "spes/sync/round/ownership_map.h"

#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/io/files.h"

namespace spes::sync {

OwnershipMap ownership_map(const Ownership& o, int64_t epoch, int64_t from_round) {
  OwnershipMap m;
  m.epoch = epoch;
  m.from_round = from_round;
  m.num_nodes = o.num_nodes();
  m.table = o.table();
  m.fingerprint = o.fingerprint();
  return m;
}

Ownership ownership_of(const OwnershipMap& m, int64_t num_nodes, int64_t layers,
                       int64_t experts, const std::string& origin) {
  if (m.epoch < 0)
    sync_fail(SyncErrc::InvalidArgument, "{}: ownership epoch {} is negative", origin, m.epoch);
  // Epoch 0 is for num_peers nodes; a later one may count the arrivals' ids (max_nodes).
  if (m.num_nodes < 1 || m.num_nodes > num_nodes)
    sync_fail(SyncErrc::InvalidArgument, "{}: the ownership map of epoch {} is for {} nodes, "
              "the run admits at most {} (spes_config.max_nodes)", origin, m.epoch, m.num_nodes,
              num_nodes);
  if (static_cast<int64_t>(m.table.size()) != layers)
    sync_fail(SyncErrc::InvalidArgument, "{}: the ownership map of epoch {} lists {} layers, "
              "the model has {}", origin, m.epoch, m.table.size(), layers);
  for (size_t l = 0; l < m.table.size(); ++l) {
    if (static_cast<int64_t>(m.table[l].size()) != experts)
      sync_fail(SyncErrc::InvalidArgument, "{}: the ownership map of epoch {} lists {} experts "
                "in layer {}, the model has {}", origin, m.epoch, m.table[l].size(), l, experts);
    for (size_t e = 0; e < m.table[l].size(); ++e)
      if (m.table[l][e] < 0 || m.table[l][e] >= m.num_nodes)
        sync_fail(SyncErrc::InvalidArgument, "{}: the ownership map of epoch {} gives expert "
                  "{} of layer {} to node {}, outside [0, {})", origin, m.epoch, e, l,
                  m.table[l][e], m.num_nodes);
  }
  Ownership o(m.num_nodes, m.table);
  if (o.fingerprint() != m.fingerprint)
    sync_fail(SyncErrc::InvalidArgument, "{}: the ownership map of epoch {} has fingerprint {} "
              "but what it lists hashes to {}: the map was damaged on the way; it is not "
              "applied", origin, m.epoch, printable(m.fingerprint, 40), o.fingerprint());
  return o;
}

nlohmann::json ownership_map_json(const OwnershipMap& m) {
  return {{"epoch", m.epoch},
          {"from_round", m.from_round},
          {"num_nodes", m.num_nodes},
          {"fingerprint", m.fingerprint},
          {"table", m.table}};
}

OwnershipMap ownership_map_at_round(const nlohmann::json& doc, int64_t round, int64_t layers,
                                    int64_t experts, const std::string& origin) {
  std::vector<OwnershipMap> epochs;
  try {
    SPES_CHECK(doc.is_object() && doc.value("format", "") == kOwnershipFileFormat,
               "not an ownership file (format '{}' expected)", kOwnershipFileFormat);
    for (const auto& e : doc.at("epochs")) epochs.push_back(ownership_map_from_json(e.at("map")));
  } catch (const std::exception& e) {
    fail("{}: {}; give the sync server's DIR/ownership.json", origin, e.what());
  }
  SPES_CHECK(!epochs.empty(), "{}: lists no ownership epoch", origin);
  const OwnershipMap* at = &epochs.front();
  for (size_t i = 0; i < epochs.size(); ++i) {
    SPES_CHECK(epochs[i].epoch == static_cast<int64_t>(i), "{}: epoch {} out of order", origin,
               epochs[i].epoch);
    (void)ownership_of(epochs[i], epochs[i].num_nodes, layers, experts, origin);
    if (epochs[i].from_round <= round) at = &epochs[i];
  }
  return *at;
}

std::pair<OwnershipMap, Ownership> round_ownership_from_file(const std::string& path,
                                                             const Ownership& initial,
                                                             int64_t round) {
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(file_read(path));
  } catch (const std::exception& e) {
    fail("'{}': {}", path, e.what());
  }
  const OwnershipMap epoch0 =
      ownership_map_at_round(doc, 0, initial.num_layers(), initial.num_experts(), path);
  SPES_CHECK(epoch0.fingerprint == initial.fingerprint(), "'{}' starts from another map ({}) "
             "than the config's ({}): it belongs to another run", path, epoch0.fingerprint,
             initial.fingerprint());
  OwnershipMap m =
      ownership_map_at_round(doc, round, initial.num_layers(), initial.num_experts(), path);
  Ownership o = ownership_of(m, m.num_nodes, initial.num_layers(), initial.num_experts(), path);
  return {std::move(m), std::move(o)};
}

OwnershipMap ownership_map_from_json(const nlohmann::json& j) {
  OwnershipMap m;
  m.epoch = j.at("epoch").get<int64_t>();
  m.from_round = j.at("from_round").get<int64_t>();
  m.num_nodes = j.at("num_nodes").get<int64_t>();
  m.fingerprint = j.at("fingerprint").get<std::string>();
  m.table = j.at("table").get<std::vector<std::vector<int64_t>>>();
  return m;
}

}  // namespace spes::sync
