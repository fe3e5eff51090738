// Hooks around a node's round: what it uploads, a filter between its upload streams and the
// wire, and an action after a round it took part in is published. Production nodes run without
// any (NodeOptions::hooks is null); the reliability tests give their nodes fault injection
// through a test-only build of the binary (tests/fault_node/), so that the tests can show what
// the server does with misbehaving nodes over real connections.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>

#include "spes/model/registry.h"
#include "spes/sync/node/client.h"
#include "spes/sync/round/plan.h"
#include "spes/sync/round/round_clock.h"
#include "spes/sync/wire/framing.h"

namespace spes::sync {

class NodeRoundHooks {
 public:
  virtual ~NodeRoundHooks() = default;
  // The upload of meta.round in place of the node's own (nullopt: the node's own). Not asked
  // for compressed uploads (their payload is the delta of delta_upload.h).
  virtual std::optional<SafetensorsStreamWriter> payload(const ParamRegistry& registry,
                                                         const UploadMeta& meta,
                                                         WireDtype wire) const = 0;
  // Stands between the client's upload streams and the wire (null: none).
  virtual std::shared_ptr<UploadStreamFilter> upload_filter() const = 0;
  // Round `round` was published with this node's upload `payload`.
  virtual void after_published(SyncClient& client, int64_t round, const RoundClock& clock,
                               const SafetensorsStreamWriter& payload) const = 0;
};

}  // namespace spes::sync
