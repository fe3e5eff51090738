// Fault injection for the reliability tests, as the round hooks (src/spes/sync/node/
// round_hooks.h) of a test-only build of the binary, `spes_fault_node` (fault_node_hooks.cpp):
// a node it runs with the environment variable SPES_SYNC_FAULTS misbehaves on purpose in chosen
// rounds, so that the tests can show what the server does with real processes over a real
// connection. The `spes` binary has no fault injection. Comma-separated items:
//   nan@R        the upload of round R carries a NaN (the node's own weights stay finite)
//   foreign@R    the upload of round R also carries an expert owned by another node
//   scaled@R     the upload of round R carries its first tensor multiplied by 1e6
//   badname@R    the upload of round R names its first tensor with bytes that are not UTF-8
//   poison@R     the upload of round R moves its first one-dimensional shared tensor (a norm
//                weight) by 4x its norm: inside every per-upload bound, an outlier among nodes
//   grow@R       from round R on, the node multiplies its own experts by 1.3 before every
//                upload (each round inside the per-round and window bounds; it compounds while
//                accepted: an owner drifting its expert without end; after a refusal the node
//                catches up with the published model)
//   corrupt@R    the first chunk of round R's first upload attempt fails its checksum
//   stall@R:S    the node sleeps S seconds before uploading round R (a straggler)
//   replay@R     after round R is published, the node uploads round R-1 again (an old round)
//   cut@R        round R's upload goes in 8 chunks and its first stream ends after 4 of them
//                (as if the connection broke); the retry resumes where the server stopped
//   dup@R        round R's upload goes in 8 chunks and chunk 1 is sent again after chunk 2
// Unset means no fault. The faults wrap what the node does, never change it: NodeFaultInjection
// hands the node its payload (nan, foreign, scaled, badname, poison), wraps the client's upload
// streams (stall, corrupt, cut, dup: an UploadStreamFilter, which compressed uploads go through
// too) and acts after a published round (replay). Leaves out: the server, which has no fault hooks.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "spes/sync/node/round_hooks.h"

namespace spes::sync {

struct NodeFaults {
  int64_t nan_round = -1, foreign_round = -1, scaled_round = -1, corrupt_round = -1;
  int64_t stall_round = -1, replay_round = -1, cut_round = -1, dup_round = -1;
  int64_t badname_round = -1, poison_round = -1, grow_round = -1;
  double stall_s = 0;
  bool any() const;
};

// Parses `spec` (the syntax above); throws with the offending item on a typo.
NodeFaults parse_node_faults(const std::string& spec);
// From $SPES_SYNC_FAULTS (none when unset).
NodeFaults node_faults_from_env();

// The faults of one node.
class NodeFaultInjection : public NodeRoundHooks {
 public:
  NodeFaultInjection(const NodeFaults& faults, int64_t node);
  // Wraps the client's upload streams: stall (before round R's first stream), corrupt, cut, dup
  // (and their chunks of an eighth).
  std::shared_ptr<UploadStreamFilter> upload_filter() const override { return filter_; }
  // A deliberately bad upload of meta.round (nan, foreign, scaled, badname, poison, grow), or none
  // (the node's own).
  std::optional<SafetensorsStreamWriter> payload(const ParamRegistry& registry,
                                                 const UploadMeta& meta,
                                                 WireDtype wire) const override;
  // Round `round` was published with this node's upload `payload`: replay@R sends it again
  // as round R-1 and checks that it is refused.
  void after_published(SyncClient& client, int64_t round, const RoundClock& clock,
                       const SafetensorsStreamWriter& payload) const override;

 private:
  NodeFaults f_;
  int64_t node_;
  std::shared_ptr<UploadStreamFilter> filter_;
};

}  // namespace spes::sync
