// AdamW over the trainable tensors only (frozen tensors get no moment tensors at all), with
// global-norm gradient clipping folded into the update, and the LR schedule (linear warm-up
// from warmup_start x peak, then cosine to alpha_f x peak). On CPU the update is one fused pass
// over (param, grad, m, v) per tensor. On a GPU the norm, the clipping factor and the update stay
// on the device: one multi-tensor norm, then torch's fused AdamW kernel (_fused_adamw_, with the
// clip as its gradient scale and a non-finite norm as its skip flag), so a step never waits for
// the device (step_queued; the norm is read back later). Matches torch.optim.AdamW (decoupled
// decay: p -= lr*wd*p; p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)). The moments are fp32, or
// bf16 / 8-bit block-wise with optimizer.moment_dtype (train/adamw_moments.h: updated with ATen
// operations over chunks on either device, since the fused CUDA kernel takes fp32 moments only).
#pragma once
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "spes/io/config.h"
#include "spes/io/safetensors.h"
#include "spes/model/registry.h"
#include "spes/train/adamw_moments.h"

namespace spes {

double lr_at_step(const Config& cfg, int64_t step);

// Moments of some experts, as AdamW holds them: per parameter name (the registry's names of
// the expert's tensors), exp_avg and exp_avg_sq (fp32, CPU), with the optimizer step count of
// that parameter, and the optimizer step its learning-rate re-warm-up started at (-1: none).
// What moves with an expert from one node to another (issue 38; Trainer::change_ownership,
// expert_moments).
struct ExpertMoments {
  struct Entry {
    torch::Tensor exp_avg, exp_avg_sq;
    int64_t step = 0;
    int64_t rewarm_from = -1;
  };
  std::map<std::string, Entry> by_name;
};

class AdamW {
 public:
  AdamW(std::vector<RegistryEntry> params, const OptimizerConfig& cfg);

  // Global L2 norm of the current gradients of the trainable tensors (missing grads count 0).
  double grad_norm() const;
  // Clips to max_norm (<= 0: no clipping) and applies one AdamW step with learning rate lr.
  // Returns the pre-clip gradient norm. Tensors without a gradient are skipped (as PyTorch).
  // A non-finite norm throws (after skipping the update). On a GPU this waits for the device
  // (step_queued, then the norm read back).
  double step(double lr, double max_grad_norm);
  // The same step without waiting for the device: returns [norm, extra...] (fp64, 1-D, on the
  // parameters' device; `extra`, when defined, flattened after the norm, so that the caller reads
  // both in one copy, train/step_figures.h). On a GPU nothing here synchronises: a non-finite
  // norm makes the fused kernel skip the update, and the reader of the norm throws with
  // check_norm(). On the CPU the step is done when this returns, and a non-finite norm throws
  // before any update.
  torch::Tensor step_queued(double lr, double max_grad_norm, const torch::Tensor& extra = {});
  // Throws unless `norm` (read back from step_queued of optimizer step `step`) is finite.
  static void check_norm(double norm, int64_t step);
  // For the next step() only: which tensors have a gradient (by params() index), instead of
  // what this process saw (data-parallel ranks agree on it; train/distributed.h).
  void set_grad_presence(std::vector<bool> present) { presence_ = std::move(present); }
  // Whether params()[i] received a gradient since the last zero_grad on this process.
  bool has_grad(size_t i) const;
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
  // "exp_avg_sq/<name>", int8's "*_absmax/<name>", "step/<name>") for checkpoints.
  NamedTensors state_tensors() const;
  // Throws (changing nothing) unless `tensors` hold a complete, well-shaped state.
  void check_state(const NamedTensors& tensors, const std::string& origin) const;
  // check_state, then replaces the moments and step counts (moments of another moment_dtype,
  // fp32 ones of older checkpoints included, are converted).
  void load_state(const NamedTensors& tensors, int64_t step_count, const std::string& origin);
  // Bytes held by optimizer moments (int8: with their block scales).
  int64_t state_bytes() const;

  // The trainable set changed (Trainer::change_ownership, at a step boundary): `params` is the
  // new list. A tensor of the old list (by name) keeps its moments, step count and any
  // re-warm-up bit for bit; a new one starts from `handed`'s entry when it has one (checked
  // beforehand by the caller: train/ownership_change.h), else from zero moments with a
  // learning-rate re-warm-up (rewarmup_steps(); none when 0). Tensors that left the list lose
  // their moments and their persistent gradient buffers.
  void change_params(std::vector<RegistryEntry> params, const ExpertMoments* handed);
  // Steps of the linear learning-rate re-warm-up of tensors that start from zero moments in
  // change_params: in the k-th optimizer step after the change such a tensor is updated with
  // lr x min(1, k / n). 0: none.
  void set_rewarmup_steps(int64_t n) { rewarmup_steps_ = n; }
  int64_t rewarmup_steps() const { return rewarmup_steps_; }
  // The factor params()[i]'s learning rate gets in the next step (1 outside a re-warm-up).
  double lr_scale(size_t i) const;
  // params()[i]'s moments as fp32 CPU values and its step count.
  ExpertMoments::Entry moments_of(size_t i) const;
  // Index of the parameter named `name` in params(), or -1.
  int64_t index_of(const std::string& name) const;
  const std::vector<RegistryEntry>& params() const { return params_; }

 private:
  std::vector<RegistryEntry> params_;
  std::vector<AdamWMoments> moments_;  // optimizer.moment_dtype (train/adamw_moments.h)
  // Steps each tensor has taken: a tensor without a gradient in a step (an expert that got no
  // tokens) is skipped and keeps its own bias correction, as in torch.optim.AdamW.
  std::vector<int64_t> tensor_steps_;
  // Per tensor: the optimizer step count when its re-warm-up began (-1: none), and its length.
  // Saved as "rewarm_from/<name>" while it lasts.
  std::vector<int64_t> rewarm_from_;
  int64_t rewarmup_steps_ = 0;
  OptimizerConfig cfg_;
  int64_t step_ = 0;  // optimizer steps taken
  // Persistent gradients: each buffer and its version counter as zero_grad left them.
  bool persistent_ = false;
  std::vector<std::pair<const void*, uint32_t>> zeroed_;
  std::vector<bool> presence_;             // set_grad_presence (empty: none given)
  std::vector<torch::Tensor> device_steps_;  // fp32 step counts for _fused_adamw_ (GPU)
  bool stepped(size_t i) const;  // has_grad, or presence_ when given
  double lr_scale_at(size_t i, int64_t step) const;  // lr_scale in optimizer step `step`
  void mark_zeroed(size_t i);
  torch::Tensor step_device(double lr, double max_grad_norm, const torch::Tensor& extra);
  // step_device's parts: the fp32 step counts on `dev` (built once, and after moments were
  // loaded); whether tensor i and its gradient suit torch's fused kernel; the update of one
  // tensor with low-precision moments, and of an fp32 one the kernel cannot take (clip: the
  // factor of the gradient; skip: 0-d, true when the step is skipped).
  void ensure_device_steps(torch::Device dev);
  bool fusable(size_t i, const torch::Tensor& g) const;
  void update_low_precision(size_t i, const torch::Tensor& g, double lr_i,
                            const torch::Tensor& clip, const torch::Tensor& skip);
  void update_unfused(size_t i, const torch::Tensor& g, double lr_i, const torch::Tensor& clip,
                      const torch::Tensor& skip);
};

}  // namespace spes
