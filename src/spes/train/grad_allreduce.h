// Data-parallel gradient reduction over the ranks of one node (distributed.h), overlapped with
// the backward pass. The trainable tensors are grouped into buckets by where backward finishes
// them: one per block, one for the final norm and the LM head, one for the rest (the embedding).
// A hook on the residual stream entering block l (ForwardResult::block_inputs) fires once that
// entry's gradient exists, which is after every gradient of block l has been written, and
// starts that bucket's all-reduce while backward goes on with the earlier blocks; the last
// bucket starts when backward returns. Gradients are summed (each rank scales its loss by
// 1 / the global number of micro-batches, so the sum is the global mean). On the per-expert
// path (fp32 CPU) an expert may get tokens on one rank only: which tensors got a gradient is
// summed too, so that every rank skips the same tensors in AdamW as one process over the whole
// batch would. Leaves out: gradient compression, ZeRO-style sharding.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <vector>

#include "spes/model/transformer.h"
#include "spes/train/distributed.h"
#include "spes/train/optimizer.h"

namespace spes {

class GradientAllReduce {
 public:
  // Needs persistent gradient buffers (AdamW::use_persistent_grads).
  GradientAllReduce(DistGroup& group, const Transformer& model, AdamW& optimizer);

  // Before the backward pass of the step's last micro-batch on this rank: hooks on its forward
  // pass's block inputs start each bucket's reduction as soon as its gradients are complete.
  void arm(const std::vector<torch::Tensor>& block_inputs);
  // After that backward pass: starts the buckets that are left, waits for every reduction,
  // then sums `extra` (e.g. the loss terms, any shape) and the gradient-presence flags over the
  // ranks and hands the flags to the optimizer. Returns the summed `extra` (on the host when
  // flags were exchanged, else still on the device, so the step waits for the device once).
  torch::Tensor finish(const torch::Tensor& extra);

  int64_t num_buckets() const { return static_cast<int64_t>(buckets_.size()); }

 private:
  void launch(size_t bucket);

  DistGroup& group_;
  AdamW& optimizer_;
  std::vector<std::vector<size_t>> buckets_;  // optimizer params() indices
  std::vector<bool> launched_;
  std::vector<std::function<void()>> waits_;
  std::vector<bool> present_;                 // local: tensor had a gradient at its launch
  bool exchange_presence_ = true;             // ranks may disagree (per-expert CPU path)
};

}  // namespace spes
