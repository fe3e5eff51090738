// The SwiGLU expert and the dropless top-k MoE layer. Tokens are sorted by expert once; each
// expert multiplies the contiguous block of its tokens (one GEMM per projection, no per-token
// loop), and one index_add scatters the weighted outputs back. Frozen experts (no
// requires_grad) still pass gradients to their inputs.
#include "spes/model/layers.h"

namespace spes {

torch::Tensor expert_forward(const ExpertWeights& e, const torch::Tensor& x) {
  torch::Tensor g = torch::matmul(x, e.w1.t());
  torch::Tensor u = torch::matmul(x, e.v1.t());
  return torch::matmul(torch::silu(g) * u, e.w2.t());
}

torch::Tensor moe_forward(const torch::Tensor& x, const torch::Tensor& router,
                          const std::vector<ExpertWeights>& experts, int64_t top_k,
                          bool norm_topk_prob, RouterStats* stats) {
  const int64_t E = static_cast<int64_t>(experts.size());
  torch::Tensor logits = torch::matmul(x, router.t()).to(at::promote_types(x.scalar_type(), torch::kFloat32));  // [N, E]
  torch::Tensor probs = torch::softmax(logits, -1);
  auto [top_w, top_i] = probs.topk(top_k, -1);  // [N, k]
  if (norm_topk_prob) top_w = top_w / top_w.sum(-1, /*keepdim=*/true);

  torch::Tensor flat_i = top_i.reshape({-1});                      // [N*k]
  // Stable sort: slots grouped by expert, each group in token order (deterministic sums).
  torch::Tensor order = std::get<1>(flat_i.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  torch::Tensor token_of_slot = order.div(top_k, "floor");         // token index of each slot
  torch::Tensor slot_w = top_w.reshape({-1}).index_select(0, order).to(x.scalar_type());
  torch::Tensor counts = torch::bincount(flat_i, {}, E);           // [E] int64
  torch::Tensor counts_cpu = counts.to(torch::kCPU);
  const int64_t* c = counts_cpu.data_ptr<int64_t>();

  torch::Tensor xs = x.index_select(0, token_of_slot);             // [N*k, D] grouped rows
  std::vector<torch::Tensor> outs;
  outs.reserve(E);
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (c[e] == 0) continue;
    outs.push_back(expert_forward(experts[e], xs.narrow(0, start, c[e])));
    start += c[e];
  }
  torch::Tensor ys = torch::cat(outs, 0) * slot_w.unsqueeze(1);    // [N*k, D]
  torch::Tensor out = torch::zeros_like(x).index_add(0, token_of_slot, ys);
  if (stats) {
    stats->logits = logits;
    stats->probs = probs;
    stats->counts = counts.to(torch::kFloat32);
  }
  return out;
}

}  // namespace spes
