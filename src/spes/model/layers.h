// The building blocks of the transformer as plain functions on tensors, each tested on its own:
// RMSNorm, rotary embeddings, causal attention, the SwiGLU expert and the MoE layer.
#pragma once
#include <torch/torch.h>

#include <vector>

#include "spes/model/transformer.h"

namespace spes {

// Whether the fused CPU kernels below handle these tensors: all on CPU, all fp32 or all fp64
// (undefined tensors are ignored), and CPU autocast off. Other devices and dtypes take the
// composite reference implementations (the *_reference functions), which the tests compare the
// kernels with, or the device paths (grouped experts, chunked loss).
bool fused_cpu_kernel_ok(at::ArrayRef<torch::Tensor> ts);
// The dtype products on t's device run in: the autocast dtype when autocast is on there, else
// t's own dtype.
torch::ScalarType autocast_compute_dtype(const torch::Tensor& t);

// RMSNorm over the last dim, computed in fp32: x * rsqrt(mean(x^2) + eps) * weight. On CPU one
// autograd node (a pass to read and one to write; backward likewise).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor rms_norm_reference(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// cos/sin tables [max_seq, head_dim] for rotate-half RoPE with base theta.
std::pair<torch::Tensor, torch::Tensor> rope_tables(int64_t max_seq, int64_t head_dim,
                                                    double theta, torch::Device device);
// Applies rotate-half RoPE to x [B, H, T, hd] with tables [>=T, hd].
torch::Tensor rope_apply(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

// Causal softmax attention. q [B, H, T, hd], k/v [B, Hkv, T, hd] (Hkv divides H).
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v);
torch::Tensor causal_attention_reference(const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v);
// The fused CPU kernel behind both: with rope, q and k are rotated by rope_apply's rotation
// with tables cos/sin [>=T, hd] first (inside the same autograd node). Needs
// fused_attention_ok(q, k, v).
bool fused_attention_ok(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);
torch::Tensor fused_causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const torch::Tensor& cos,
                                     const torch::Tensor& sin, bool rope);

// Full attention sub-layer on normed input x [B, T, D] (projections, QK-norm, RoPE, output).
torch::Tensor attention_forward(const BlockWeights& b, const torch::Tensor& x,
                                const ModelConfig& cfg, const torch::Tensor& cos,
                                const torch::Tensor& sin);

// SwiGLU expert: W2 (silu(W1 x) * (V1 x)) for x [N, D]. On CPU one autograd node that keeps
// x, W1 x and V1 x only and skips the weight gradients of frozen experts.
torch::Tensor expert_forward(const ExpertWeights& e, const torch::Tensor& x);
torch::Tensor expert_forward_reference(const ExpertWeights& e, const torch::Tensor& x);

// Dropless top-k MoE on x [N, D]: tokens are grouped by expert and each expert runs one matrix
// product over its tokens. Router statistics are written to `stats` when given.
torch::Tensor moe_forward(const torch::Tensor& x, const torch::Tensor& router,
                          const std::vector<ExpertWeights>& experts, int64_t top_k,
                          bool norm_topk_prob, RouterStats* stats);
// The same layer over the stacked layout of expert_stack.h (grouped_experts.cpp): grouped
// GEMMs in the stack's dtype, no host synchronisation, weight gradients for the trainable
// slots only. Needs d_model and the expert hidden size to be multiples of 8.
torch::Tensor moe_forward_grouped(const torch::Tensor& x, const torch::Tensor& router,
                                  const std::vector<ExpertWeights>& experts,
                                  const ExpertStack& stack, int64_t top_k, bool norm_topk_prob,
                                  RouterStats* stats);

}  // namespace spes
