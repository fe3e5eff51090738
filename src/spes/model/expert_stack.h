// The experts of one MoE layer laid out for grouped GEMMs: two stacked tensors in the compute
// dtype, w13 [E, 2F, D] (the gate rows W1 then the up rows V1 of each expert) and w2 [E, D, F],
// one "slot" per expert. Slots are in compute order: the experts this node trains come first,
// so the weight gradients of the grouped backward cover slots [0, n_trainable) only and frozen
// experts cost no weight-gradient GEMM.
//
// An expert's tensors (the ones the registry, checkpoints and sync see, under their Hugging
// Face names) are either views of its slot ("in place": no second copy) or tensors of their
// own ("owned", fp32) whose slot holds a copy in the compute dtype, refreshed before a forward
// pass when a tensor changed (version counters: an optimizer step, a checkpoint load or a sync
// download all bump them). Which: trainable experts are owned unless the compute dtype is fp32
// (their fp32 master weights); frozen experts are in place when their storage dtype is the
// compute dtype (bf16 under amp_bf16: no fp32 copy at all), else owned.
// Leaves out: any per-expert reshaping of the weights (they keep their [F, D] / [D, F] shapes).
#pragma once
#include <torch/torch.h>

#include <memory>
#include <mutex>
#include <vector>

namespace spes {

struct ExpertWeights;

struct ExpertStack {
  torch::Tensor w13;                    // [E, 2F, D] compute dtype
  torch::Tensor w2;                     // [E, D, F] compute dtype
  std::vector<int64_t> expert_of_slot;  // [E] slot -> expert index
  torch::Tensor slot_of_expert;         // [E] int64 on the model's device: expert -> slot
  int64_t n_trainable = 0;              // slots [0, n_trainable) are trained on this node
  std::vector<bool> owned;              // [E] by slot: the expert has tensors of its own
  // Shared by a model and its replicas (train/micro_batch_workers.h): last copied versions.
  struct Sync {
    std::mutex mu;
    std::vector<uint32_t> versions;  // 3 per slot (w1, v1, w2); kNever until first copied
  };
  std::shared_ptr<Sync> sync;

  static constexpr uint32_t kNever = 0xffffffffu;

  bool defined() const { return w13.defined(); }
  torch::ScalarType dtype() const { return w13.scalar_type(); }
};

// Builds the stack of one layer and points `experts` (E entries, any previous tensors replaced)
// at it. trainable[e]: expert e is trained on this node; frozen_dtype: storage of the others.
ExpertStack expert_stack_create(std::vector<ExpertWeights>& experts,
                                const std::vector<bool>& trainable, int64_t d_model,
                                int64_t hidden, torch::ScalarType compute_dtype,
                                torch::ScalarType frozen_dtype, torch::Device device);

// Copies every owned expert whose tensors changed since the last copy into its slot. Cheap when
// nothing changed (a version comparison per tensor, on the host). Thread-safe.
void expert_stack_refresh(const ExpertStack& stack, const std::vector<ExpertWeights>& experts);

}  // namespace spes
