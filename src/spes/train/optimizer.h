// AdamW over the trainable tensors only (frozen tensors get no moment tensors at all), with
// global-norm gradient clipping folded into the update, and the LR schedule (linear warm-up
// from warmup_start x peak, then cosine to alpha_f x peak). On CPU the update is one fused pass
// over (param, grad, m, v) per tensor; on other devices it uses tensor ops. Matches
// torch.optim.AdamW (decoupled decay: p -= lr*wd*p; p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)).
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

#include "spes/io/config.h"
#include "spes/io/safetensors.h"
#include "spes/model/registry.h"

namespace spes {

double lr_at_step(const Config& cfg, int64_t step);

class AdamW {
 public:
  AdamW(std::vector<RegistryEntry> params, const OptimizerConfig& cfg);

  // Global L2 norm of the current gradients of the trainable tensors (missing grads count 0).
  double grad_norm() const;
  // Clips to max_norm (<= 0: no clipping) and applies one AdamW step with learning rate lr.
  // Returns the pre-clip gradient norm. Tensors without a gradient are skipped (as PyTorch).
  double step(double lr, double max_grad_norm);
  // Drops every gradient (set to undefined, freeing its memory until the next backward), or,
  // with persistent gradients, zeroes the buffers that received a gradient.
  void zero_grad();
  // Gives every trainable tensor one gradient buffer for the whole run (allocated now, zeroed
  // in place by zero_grad) instead of buffers that backward allocates and zero_grad frees.
  // Peak memory is then weights + gradients + moments + activations whatever the moment of
  // the peak, so frozen tensors save exactly their gradient and moment bytes. Backward adds
  // into the buffers; a buffer whose version counter has not moved since zero_grad received
  // no gradient in this step and is skipped by step(), as a missing gradient is otherwise.
  void use_persistent_grads();
  bool persistent_grads() const { return persistent_; }

  int64_t step_count() const { return step_; }
  // Moments and per-tensor step counts as named tensors ("exp_avg/<name>",
  // "exp_avg_sq/<name>", "step/<name>") for checkpoints.
  NamedTensors state_tensors() const;
  // Throws (changing nothing) unless `tensors` hold a complete, well-shaped state.
  void check_state(const NamedTensors& tensors, const std::string& origin) const;
  // check_state, then replaces the moments and step counts.
  void load_state(const NamedTensors& tensors, int64_t step_count, const std::string& origin);
  // Bytes held by optimizer moments.
  int64_t state_bytes() const;
  const std::vector<RegistryEntry>& params() const { return params_; }

 private:
  std::vector<RegistryEntry> params_;
  std::vector<torch::Tensor> exp_avg_, exp_avg_sq_;
  // Steps each tensor has taken: a tensor without a gradient in a step (an expert that got no
  // tokens) is skipped and keeps its own bias correction, as in torch.optim.AdamW.
  std::vector<int64_t> tensor_steps_;
  OptimizerConfig cfg_;
  int64_t step_ = 0;  // optimizer steps taken
  // Persistent gradients: each buffer and its version counter as zero_grad left them.
  bool persistent_ = false;
  std::vector<std::pair<const void*, uint32_t>> zeroed_;
  bool has_grad(size_t i) const;
  void mark_zeroed(size_t i);
};

}  // namespace spes
