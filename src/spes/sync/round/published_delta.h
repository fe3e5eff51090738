// Compressed downloads (docs/PROTOCOL.md, "Compressed deltas"): with spes_config.compression
// bf16 or int8 the published model is not the round's aggregate itself but
// P_new = P_prev + deq(D) with D = Q(P_agg - P_prev), per tensor the round may have changed,
// computed with the same codec and kernel as uploads, so that a node holding P_prev rebuilds
// P_new bit for bit from D (the delta file the server persists and serves). An owner-copied
// expert that merging did not touch is published as its owner's rebuilt upload exactly: its D is
// the q the owner sent (read back from the owner's staged upload), and the owner, which already
// holds that value, is not sent it. Here: computing D and P_new (from P_prev in a file or in
// memory), piece by piece, each piece of D going straight to the delta file (delta_file.h), so
// that D is never held whole. Leaves out: the file's format and record (delta_file.h), serving
// (server/download_session.h), applying on a node (node/download.h). With topk, D of a tensor
// is computed whole (P_prev read into one tensor) by the model's SparsePublisher.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "spes/sync/round/aggregate.h"
#include "spes/sync/round/delta_file.h"
#include "spes/sync/wire/delta_codec.h"

namespace spes::sync {

// Which tensors a published round's delta holds, and which of them are their owner's upload
// exactly (both ascending model indices).
struct PublishedDelta {
  std::vector<size_t> tensors;
  std::vector<size_t> owner_exact;
};

// True when a round may change tensor `t` (someone uploads it, or merging touches experts).
bool round_may_change(const PlanTensor& t, bool merged);

// The tensors of a round's delta (those it may change, model order) and the ones that may be
// their owner's upload exactly (the owner copies of a round without merging): the layout a
// DeltaFileWriter is opened with before quantise_publication.
PublishedDelta delta_layout(const RoundPlan& plan, const RoundOutcome& outcome);

// Turns the round's aggregate, held in `model`'s tensors, into the published model, tensor by
// tensor: give every tensor wants() asks for its previous published fp32 values (any order),
// then finish(). Takes `outcome.owner_deltas`. With `file`, D goes there piece by piece (its
// tensors: delta_layout's); without, D is computed and dropped (an offline round).
class PublicationQuantiser {
 public:
  PublicationQuantiser(SyncModel& model, RoundOutcome& outcome, DeltaFileWriter* file);
  bool wants(size_t i) const;
  // `read_prev(first, n, out)`: writes P_prev's values [first, first + n) of tensor i to out.
  // The tensor is processed in block-aligned pieces of kPieceValues (memory: a few pieces).
  using PrevReader = std::function<void(int64_t first, int64_t n, float* out)>;
  void tensor(size_t i, const PrevReader& read_prev);
  PublishedDelta finish();
  static constexpr int64_t kPieceValues = kDeltaBlock * 4096;  // 4 MiB of fp32

 private:
  // True (its q written to the file) when tensor i, given by its owner, is P_prev + deq(q) of
  // the owner's staged q exactly; false (nothing usable written) otherwise.
  bool owner_exact(size_t i, const StagedDelta& own, const PrevReader& read_prev);
  // compression: topk: D = the SparsePublisher's topk(P_agg - P_prev + R), or the owner's staged
  // payload exactly when it rebuilds the aggregate bit for bit (sparse_publication.h).
  void topk_tensor(size_t i, const PrevReader& read_prev);
  bool topk_owner_exact(size_t i, const StagedDelta& own, const torch::Tensor& prev,
                        std::string* payload);
  SyncModel& model_;
  bool merged_;
  DeltaFileWriter* file_;
  std::map<size_t, StagedDelta> owner_;
  std::vector<bool> wanted_, done_, exact_;
  std::vector<float> prev_, work_, scales_;  // one piece each
  std::vector<char> q_;
};

// The quantiser driven by P_prev read from a published model file (pread, piece by piece), or
// by P_prev in memory (model order, every tensor).
PublishedDelta quantise_publication(SyncModel& model, RoundOutcome& outcome,
                                    const std::string& prev_file, DeltaFileWriter* file);
PublishedDelta quantise_publication(SyncModel& model, RoundOutcome& outcome,
                                    const std::vector<torch::Tensor>& prev,
                                    DeltaFileWriter* file = nullptr);

}  // namespace spes::sync
