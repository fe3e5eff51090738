// The way down for top-k sparse deltas (spes_config.compression: topk; docs/PROTOCOL.md,
// "Sparse deltas", issue 37 item 2): the server publishes, per tensor the round changed, the
// change D = topk(P_agg - P_prev + R) and P_new = P_prev + deq(D) (the checked decode and the
// rebuild kernel every node runs, so every node that holds P_prev rebuilds P_new bit for bit),
// keeping the dense residual R = (P_agg - P_prev + R) - deq(D): server-side error feedback, so
// that at 1-3% density the averaged change is published over the next rounds instead of being
// dropped. An owner's expert in a round without merging is published as its owner's upload
// exactly (D = the owner's payload) and its residual is dropped. R (fp32, the size of the
// tensors rounds change) is saved beside the round (save) and taken back by a restarted server
// when it belongs to the round it resumes (load); otherwise it restarts at zero.
// Leaves out: the codec (wire/topk_codec.h), the round's aggregation (aggregate.h), and the
// round paths of the server and the node, which do not carry top-k deltas yet.
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

#include "spes/sync/round/topk_feedback.h"

namespace spes::sync {

class SparsePublisher {
 public:
  SparsePublisher(TopkParams p, size_t tensors);
  // Tensor i: `prev` P_prev, `agg` P_agg on entry and P_new on return (fp32 CPU contiguous).
  // Returns D's payload. Throws SyncError(InvalidArgument) naming `name` when the change is not
  // finite (the residual then stays as it was).
  std::string publish(size_t i, const torch::Tensor& prev, torch::Tensor& agg,
                      const std::string& name);
  // Tensor i went out as its owner's upload exactly: its residual is dropped.
  void publish_exact(size_t i);
  const TopkFeedback& residual() const { return residual_; }
  // R to `path` (safetensors, tensors named by `names`, metadata round and model_sha256 of the
  // published model it belongs to), streamed to a temporary file, fsynced and renamed.
  void save(const std::string& path, const std::vector<std::string>& names, int64_t round,
            const std::string& model_sha256) const;
  // Takes R back from `path` when it belongs to (round, model_sha256) and matches `names` and
  // `numels`; returns false (R = 0) when the file is missing, damaged or of another round.
  bool load(const std::string& path, const std::vector<std::string>& names,
            const std::vector<int64_t>& numels, int64_t round, const std::string& model_sha256);

 private:
  TopkFeedback residual_;
};

}  // namespace spes::sync
