// The OLMoE-style MoE transformer (SPES.md section 2): embeddings, L blocks of
// h = x + Attn(RMSNorm(x)), y = h + MoE(RMSNorm(h)), final RMSNorm, untied LM head; no biases.
// A dense-FFN variant (one SwiGLU MLP per block) is the source model for upcycling.
// Weights are plain tensors named after the Hugging Face OLMoE convention; every tensor is
// listed once in params(), which the parameter registry (model/registry.h) builds on.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "spes/io/config.h"
#include "spes/model/expert_stack.h"

namespace spes {

struct InitialWeights;  // model/initial_weights.h

enum class ParamRole { Shared, Expert };

struct ParamInfo {
  std::string name;      // e.g. model.layers.3.mlp.experts.5.gate_proj.weight
  torch::Tensor tensor;  // the parameter itself (a leaf; requires_grad set by the registry)
  ParamRole role = ParamRole::Shared;
  int64_t layer = -1;    // experts only
  int64_t expert = -1;   // experts only
};

struct ExpertWeights {
  torch::Tensor w1;  // gate_proj [F, D]
  torch::Tensor v1;  // up_proj   [F, D]
  torch::Tensor w2;  // down_proj [D, F]
};

struct BlockWeights {
  torch::Tensor attn_norm, q, k, v, o, q_norm, k_norm, mlp_norm;
  torch::Tensor router;               // [E, D] (MoE only)
  std::vector<ExpertWeights> experts; // E entries (MoE) or 1 entry (dense MLP)
  ExpertStack stack;                  // defined when the experts run as grouped GEMMs
};

// How a model stores and runs its weights beyond the architecture. The default is the fp32
// layout with one tensor per expert (the fused CPU kernels); the trainer derives the rest from
// `precision`, `activation_checkpointing` and what this node trains (train/device.h).
struct ModelRuntime {
  // Experts of each MoE layer stacked in this dtype for grouped GEMMs (expert_stack.h);
  // kUndefined: one tensor per expert.
  torch::ScalarType grouped_dtype = torch::ScalarType::Undefined;
  // [layer][expert]: trained on this node (empty: every expert). Frozen experts are stored in
  // frozen_dtype (bf16 under amp_bf16: they get no update, so they need no fp32 master).
  std::vector<std::vector<bool>> trainable_experts;
  torch::ScalarType frozen_dtype = torch::kFloat32;
  // Activation checkpointing: blocks l with l % checkpoint_every == 0 keep only their input and
  // recompute the rest in backward (0: off).
  int64_t checkpoint_every = 0;

  bool grouped() const { return grouped_dtype != torch::ScalarType::Undefined; }
};

// What one MoE layer's router did in a forward pass (for the auxiliary losses and metrics).
struct RouterStats {
  torch::Tensor logits;  // [N, E] fp32 router logits
  torch::Tensor probs;   // [N, E] fp32 softmax over all experts
  torch::Tensor counts;  // [E] fp32 tokens routed to each expert over all k slots (no grad)
};

struct ForwardResult {
  torch::Tensor hidden;              // [B, T, D] final normed hidden state
  std::vector<RouterStats> routers;  // one per MoE layer
  // The residual stream entering each block, then the one entering the final norm: once the
  // gradient of entry l has been computed, every parameter of block l (of the final norm and
  // head for the last entry) has its gradient (distributed gradient buckets hook on them).
  std::vector<torch::Tensor> block_inputs;
};

class Transformer {
 public:
  Transformer(const ModelConfig& cfg, torch::Device device = torch::kCPU,
              ModelRuntime runtime = {});

  // Truncated-normal init (std, cut at +-cutoff*std) of every matrix; norm weights 1. Given
  // `initial` (model.init_checkpoint, read by the command that builds the model and handed
  // down), copies those weights in instead (seed unused). A model section that names
  // model.init_checkpoint needs them: without, this throws rather than start from random weights.
  void init_weights(uint64_t seed, const InitialWeights* initial = nullptr);
  // Copies given starting weights in: same architecture, same names and shapes (checked).
  void load_initial_weights(const InitialWeights& weights);
  // Final hidden states for token ids [B, T] (no LM head: the loss applies it in chunks).
  ForwardResult forward(const torch::Tensor& tokens) const;
  // Logits [B, T, V] (forward + LM head), for evaluation and generation.
  torch::Tensor logits(const torch::Tensor& tokens) const;

  // A node's trainable set changed (train/trainer.h, change_ownership): with grouped experts,
  // each MoE layer whose row differs gets a new stack laid out for `trainable` ([layer][expert],
  // as ModelRuntime::trainable_experts), its experts' values copied in (an expert that becomes
  // frozen is rounded to frozen_dtype where that is bf16, as loading it into a model laid out
  // for it would), and params() points at the new tensors (requires_grad: the registry's job).
  // Without grouped experts nothing is stored differently: nothing to do.
  // Anything holding the old tensors (a registry, an optimizer, replicas) must be rebuilt.
  void set_trainable_experts(const std::vector<std::vector<bool>>& trainable);

  // A second model over the same weight storage: every parameter is a new leaf tensor aliasing
  // this one's data (so in-place updates of either are seen by both) with the same
  // requires_grad but its own .grad. Lets several threads run backward passes at once, each
  // into its own gradient buffers (train/micro_batch_workers.h).
  Transformer replica_sharing_weights() const;

  const ModelConfig& config() const { return cfg_; }
  const ModelRuntime& runtime() const { return runtime_; }
  torch::Device device() const { return device_; }
  const std::vector<ParamInfo>& params() const { return params_; }
  const torch::Tensor& lm_head() const { return lm_head_; }
  int64_t num_params() const;

 private:
  // One block; checkpointed when the runtime says so (and a graph is being built).
  torch::Tensor block_forward(int64_t layer, const torch::Tensor& x,
                              std::vector<RouterStats>* routers) const;
  torch::Tensor block_forward_plain(const BlockWeights& b, const torch::Tensor& x,
                                    RouterStats* stats) const;
  void add_param(const std::string& name, torch::Tensor t, ParamRole role = ParamRole::Shared,
                 int64_t layer = -1, int64_t expert = -1);
  // The constructor's steps: the runtime checked against the config; fp32 weights on the
  // model's device (zeros, ones; add_zero_weight also registers it); per block the attention's weights, its two layer norms, and
  // the MoE layer (router, experts: own tensors or views of the grouped stack) or dense MLP.
  void check_runtime() const;
  torch::Tensor zero_weight(at::IntArrayRef shape) const;
  torch::Tensor one_weight(int64_t n) const;
  void add_zero_weight(torch::Tensor& slot, at::IntArrayRef shape, const std::string& name);
  void add_attention(int64_t l);
  void add_layer_norms(int64_t l);
  void add_moe(int64_t l);
  void add_dense_mlp(int64_t l);

  ModelConfig cfg_;
  torch::Device device_;
  ModelRuntime runtime_;
  torch::Tensor embed_, final_norm_, lm_head_;
  std::vector<BlockWeights> blocks_;
  torch::Tensor rope_cos_, rope_sin_;  // [max_seq, head_dim]
  std::vector<ParamInfo> params_;
};

// A copy of `model` (same weights, no grad) on `device`, in the default layout: for evaluation
// and sampling on a GPU.
std::unique_ptr<Transformer> transformer_on_device(const Transformer& model,
                                                   const torch::Device& device);

// Hugging Face name of an expert tensor: proj is gate_proj | up_proj | down_proj.
std::string expert_param_name(int64_t layer, int64_t expert, const std::string& proj);

}  // namespace spes
