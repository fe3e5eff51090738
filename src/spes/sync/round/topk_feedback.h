// Error feedback for top-k sparse deltas (spes_config.compression: topk; docs/PROTOCOL.md,
// "Sparse deltas"): what a sender keeps of what it did not send. Per tensor an fp32
// accumulator a (on CPU, zero at the start): each round a = topk_decay x a + change, the
// sender sends topk(a) and keeps a = a - deq(sent). With topk_decay = 1 what was sent over the
// rounds plus what is held equals the sum of the changes; below 1 it is SparseLoCo's decayed
// accumulator. The node keeps one for its upload, the server one for the published change (its
// dense residual, sparse_publication.h). Leaves out: the codec
// (wire/topk_codec.h).
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

#include "spes/sync/wire/topk_codec.h"

namespace spes::sync {

class TopkFeedback {
 public:
  TopkFeedback(TopkParams p, double decay) : p_(p), decay_(decay) {}
  const TopkParams& params() const { return p_; }
  double decay() const { return decay_; }
  // Drops what is held: `tensors` zero accumulators, created at each tensor's first encode.
  void reset(size_t tensors);
  size_t size() const { return held_.size(); }
  // a_k = decay x a_k + change; returns topk(a_k) (payload and dequantised values) and keeps
  // a_k - deq. A change with NaN/Inf throws SyncError(InvalidArgument) naming `name`, and what
  // is held stays as it was.
  TopkEncoded encode(size_t k, const torch::Tensor& change, const std::string& name);
  // What tensor k holds (undefined before its first encode).
  const torch::Tensor& held(size_t k) const { return held_.at(k); }
  // Takes a held state back (a checkpoint): one fp32 tensor per index, or undefined.
  void restore(std::vector<torch::Tensor> held);
  const std::vector<torch::Tensor>& state() const { return held_; }
  // sum of squares of everything held (for metrics).
  double held_sq() const;

 private:
  TopkParams p_;
  double decay_;
  std::vector<torch::Tensor> held_;
};

}  // namespace spes::sync
