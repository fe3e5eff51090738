// The OLMoE-style MoE transformer (SPES.md section 2): embeddings, L blocks of
// h = x + Attn(RMSNorm(x)), y = h + MoE(RMSNorm(h)), final RMSNorm, untied LM head; no biases.
// A dense-FFN variant (one SwiGLU MLP per block) is the source model for upcycling.
// Weights are plain tensors named after the Hugging Face OLMoE convention; every tensor is
// listed once in params(), which the parameter registry (model/registry.h) builds on.
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

#include "spes/io/config.h"

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
};

class Transformer {
 public:
  Transformer(const ModelConfig& cfg, torch::Device device = torch::kCPU);

  // Truncated-normal init (std, cut at +-cutoff*std) of every matrix; norm weights 1. With
  // model.init_checkpoint set, copies that checkpoint's weights instead (seed unused; read by
  // the reader installed in model/initial_weights.h).
  void init_weights(uint64_t seed);
  // Copies given starting weights in: same architecture, same names and shapes (checked).
  void load_initial_weights(const InitialWeights& weights);
  // Final hidden states for token ids [B, T] (no LM head: the loss applies it in chunks).
  ForwardResult forward(const torch::Tensor& tokens) const;
  // Logits [B, T, V] (forward + LM head), for evaluation and generation.
  torch::Tensor logits(const torch::Tensor& tokens) const;

  // A second model over the same weight storage: every parameter is a new leaf tensor aliasing
  // this one's data (so in-place updates of either are seen by both) with the same
  // requires_grad but its own .grad. Lets several threads run backward passes at once, each
  // into its own gradient buffers (train/micro_batch_workers.h).
  Transformer replica_sharing_weights() const;

  const ModelConfig& config() const { return cfg_; }
  torch::Device device() const { return device_; }
  const std::vector<ParamInfo>& params() const { return params_; }
  const torch::Tensor& lm_head() const { return lm_head_; }
  int64_t num_params() const;

 private:
  torch::Tensor block_forward(const BlockWeights& b, const torch::Tensor& x,
                              std::vector<RouterStats>* routers) const;
  void add_param(const std::string& name, torch::Tensor t, ParamRole role = ParamRole::Shared,
                 int64_t layer = -1, int64_t expert = -1);

  ModelConfig cfg_;
  torch::Device device_;
  torch::Tensor embed_, final_norm_, lm_head_;
  std::vector<BlockWeights> blocks_;
  torch::Tensor rope_cos_, rope_sin_;  // [max_seq, head_dim]
  std::vector<ParamInfo> params_;
};

// Hugging Face name of an expert tensor: proj is gate_proj | up_proj | down_proj.
std::string expert_param_name(int64_t layer, int64_t expert, const std::string& proj);

}  // namespace spes
