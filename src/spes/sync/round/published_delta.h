// Compressed downloads (docs/PROTOCOL.md, "Compressed deltas"): with spes_config.compression
// bf16 or int8 the published model is not the round's aggregate itself but
// P_new = P_prev + deq(D) with D = Q(P_agg - P_prev), per tensor the round may have changed,
// computed with the same codec and kernel as uploads, so that a node holding P_prev rebuilds
// P_new bit for bit from D (the delta file the server persists and serves). An owner-copied
// expert that merging did not touch is published as its owner's rebuilt upload exactly: its D is
// the q the owner sent (kept by the aggregator), and the owner, which already holds that value,
// is not sent it. Here: computing D and P_new (from P_prev in a file or in memory), the delta
// file's tensors and metadata, and the record a server keeps of it. Leaves out: persisting
// (server/round_store.h), serving (server/download_session.h), applying on a node
// (node/download.h).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "spes/sync/round/aggregate.h"
#include "spes/sync/wire/delta_codec.h"

namespace spes::sync {

// A published round's delta from the previous published round, in memory until persisted.
struct PublishedDelta {
  std::vector<size_t> tensors;      // model indices, ascending
  std::vector<EncodedDelta> q;      // D of each of `tensors`
  std::vector<size_t> owner_exact;  // tensors whose D is their owner's own upload, ascending
};

// What a server knows of the delta file of its latest published round (kept in memory; read
// back from the file's header on restart).
struct DeltaRecord {
  int64_t round = -1, from_round = -1;
  std::string model_sha256, from_sha256;
  std::vector<size_t> tensors, owner_exact;
  bool valid() const { return round >= 1; }
};

// True when a round may change tensor `t` (someone uploads it, or merging touches experts).
bool round_may_change(const PlanTensor& t, bool merged);

// Turns the round's aggregate, held in `model`'s tensors, into the published model, tensor by
// tensor: give every tensor wants() asks for its previous published fp32 values (any order),
// then finish(). Takes `outcome.owner_deltas`.
class PublicationQuantiser {
 public:
  PublicationQuantiser(SyncModel& model, RoundOutcome& outcome);
  bool wants(size_t i) const;
  // `read_prev(first, n, out)`: writes P_prev's values [first, first + n) of tensor i to out.
  // The tensor is processed in block-aligned pieces of kPieceValues (memory: a few pieces).
  using PrevReader = std::function<void(int64_t first, int64_t n, float* out)>;
  void tensor(size_t i, const PrevReader& read_prev);
  PublishedDelta finish();
  static constexpr int64_t kPieceValues = kDeltaBlock * 4096;  // 4 MiB of fp32

 private:
  SyncModel& model_;
  bool merged_;
  std::map<size_t, EncodedDelta> owner_;
  std::vector<EncodedDelta> q_;  // per model tensor (undefined: not given yet / unchanged)
  std::vector<bool> wanted_, exact_;
};

// The quantiser driven by P_prev read from a published model file (pread, piece by piece), or
// by P_prev in memory (model order, every tensor).
PublishedDelta quantise_publication(SyncModel& model, RoundOutcome& outcome,
                                    const std::string& prev_file);
PublishedDelta quantise_publication(SyncModel& model, RoundOutcome& outcome,
                                    const std::vector<torch::Tensor>& prev);

// The delta file: per tensor of `d`, in model order, int8: "NAME:scale" then NAME; bf16: NAME;
// metadata format "spes-delta-v1", round, from_round, model_sha256, from_sha256, compression,
// owner_exact (comma-separated model indices).
SafetensorsStreamWriter delta_file_writer(const RoundPlan& plan, const PublishedDelta& d,
                                          const DeltaRecord& record);
// The record of a delta file from its header; throws when the header does not fit the plan.
DeltaRecord delta_record_of(const RoundPlan& plan, const StreamHeader& header,
                            const std::string& origin);
// The stream entry names of a delta download for `node`: the record's tensors (with their
// scales), less the node's owner_exact experts when `used` (the round used its upload).
std::vector<std::string> delta_download_names(const RoundPlan& plan, const DeltaRecord& r,
                                              int64_t node, bool used);

}  // namespace spes::sync
