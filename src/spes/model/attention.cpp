// Causal multi-head attention with optional GQA, whole-vector (OLMoE) or per-head (Qwen3)
// QK-norm and rotate-half RoPE. Uses scaled_dot_product_attention where libtorch has it
// (2.x); otherwise an explicit softmax(QK^T/sqrt(d) + causal mask) V.
#include <cmath>

#include "spes/model/layers.h"

namespace spes {

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v) {
  const int64_t H = q.size(1), Hkv = k.size(1), T = q.size(2), hd = q.size(3);
  torch::Tensor kk = k, vv = v;
  if (Hkv != H) {
    kk = k.repeat_interleave(H / Hkv, 1);
    vv = v.repeat_interleave(H / Hkv, 1);
  }
#if defined(TORCH_VERSION_MAJOR) && TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, kk, vv, {}, 0.0, /*is_causal=*/true);
#else
  torch::Tensor scores = torch::matmul(q, kk.transpose(-2, -1)) * (1.0 / std::sqrt(double(hd)));
  torch::Tensor mask = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(q.device()))
                           .triu(1);
  scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  torch::Tensor probs = torch::softmax(scores, -1, at::promote_types(q.scalar_type(), torch::kFloat32)).to(q.scalar_type());
  return torch::matmul(probs, vv);
#endif
}

torch::Tensor attention_forward(const BlockWeights& b, const torch::Tensor& x,
                                const ModelConfig& cfg, const torch::Tensor& cos,
                                const torch::Tensor& sin) {
  const int64_t B = x.size(0), T = x.size(1), H = cfg.n_heads, Hkv = cfg.kv_heads();
  const int64_t hd = cfg.head_dim();
  torch::Tensor q = torch::matmul(x, b.q.t());
  torch::Tensor k = torch::matmul(x, b.k.t());
  torch::Tensor v = torch::matmul(x, b.v.t());
  if (cfg.qk_norm == "whole") {
    q = rms_norm(q, b.q_norm, cfg.layer_norm_eps);
    k = rms_norm(k, b.k_norm, cfg.layer_norm_eps);
  }
  q = q.view({B, T, H, hd});
  k = k.view({B, T, Hkv, hd});
  if (cfg.qk_norm == "per_head") {
    q = rms_norm(q, b.q_norm, cfg.layer_norm_eps);
    k = rms_norm(k, b.k_norm, cfg.layer_norm_eps);
  }
  q = rope_apply(q.transpose(1, 2), cos, sin);
  k = rope_apply(k.transpose(1, 2), cos, sin);
  v = v.view({B, T, Hkv, hd}).transpose(1, 2);
  torch::Tensor y = causal_attention(q, k, v);  // [B, H, T, hd]
  y = y.transpose(1, 2).reshape({B, T, H * hd});
  return torch::matmul(y, b.o.t());
}

}  // namespace spes
