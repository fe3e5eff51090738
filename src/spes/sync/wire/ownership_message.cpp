// Ownership maps on the wire (see ownership_message.h).
#include "spes/sync/wire/ownership_message.h"

namespace spes::sync {

void ownership_to_message(const OwnershipMap& m, ::spes::sync::v1::OwnershipMap* out) {
  out->set_epoch(m.epoch);
  out->set_from_round(m.from_round);
  out->set_num_nodes(m.num_nodes);
  out->set_num_layers(static_cast<int64_t>(m.table.size()));
  for (const auto& row : m.table)
    for (int64_t owner : row) out->add_owners(owner);
  out->set_fingerprint(m.fingerprint);
}

OwnershipMap ownership_from_message(const ::spes::sync::v1::OwnershipMap& in) {
  OwnershipMap m;
  if (in.fingerprint().empty()) return m;
  const int64_t layers = in.num_layers(), n = in.owners_size();
  if (layers < 0 || n > kMaxOwnershipEntries || (layers == 0 && n != 0) ||
      (layers > 0 && n % layers != 0))
    sync_fail(SyncErrc::InvalidArgument, "ownership map of epoch {}: {} owners do not fill {} "
              "equal layers (at most {} entries)", in.epoch(), n, layers, kMaxOwnershipEntries);
  m.epoch = in.epoch();
  m.from_round = in.from_round();
  m.num_nodes = in.num_nodes();
  m.fingerprint = in.fingerprint();
  const int64_t per = layers > 0 ? n / layers : 0;
  m.table.assign(static_cast<size_t>(layers), std::vector<int64_t>(static_cast<size_t>(per)));
  for (int64_t i = 0; i < n; ++i)
    m.table[static_cast<size_t>(i / per)][static_cast<size_t>(i % per)] = in.owners(static_cast<int>(i));
  return m;
}

}  // namespace spes::sync
