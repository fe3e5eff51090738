// An ownership epoch's map (protocol.h OwnershipMap) to and from its message
// (proto/spes_sync.proto OwnershipMap: the table flattened layer by layer). Reading checks the
// message's sizes only; what the map means is checked by round/ownership_map.h.
#pragma once
#include "spes/sync/wire/protocol.h"
#include "spes_sync.pb.h"

namespace spes::sync {

void ownership_to_message(const OwnershipMap& m, ::spes::sync::v1::OwnershipMap* out);
// An absent message (no fingerprint) gives an empty map. Throws SyncError(InvalidArgument)
// when the owners do not fill num_layers equal rows or exceed kMaxOwnershipEntries.
OwnershipMap ownership_from_message(const ::spes::sync::v1::OwnershipMap& in);
constexpr int64_t kMaxOwnershipEntries = 1 << 20;  // layers x experts a map may list

}  // namespace spes::sync
