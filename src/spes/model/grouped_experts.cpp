// The MoE layer over a stacked expert layout (expert_stack.h) with grouped GEMMs and no host
// synchronisation: routing, sorting by expert, the per-expert row counts and offsets all stay on
// the device, and every product over the experts is one at::_grouped_mm call (torch's CUTLASS
// grouped GEMM for bf16 on Hopper/Blackwell; elsewhere torch's own fallback, one GEMM per
// expert, which reads the offsets on the host). Gathers and scatters use permutations (no
// atomics with repeated indices), so results do not depend on scheduling. Leaves out: expert
// capacity limits (dropless, as SPES.md) and the fused CPU kernels of moe.cpp, which the fp32
// CPU path keeps.
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "spes/model/expert_stack.h"
#include "spes/model/layers.h"

namespace spes {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// Adds gradient g into leaf w's persistent gradient buffer when it has one (as moe.cpp's
// weight_grad: no temporary for autograd to accumulate; fp32 buffers take bf16 gradients) and
// returns nothing; otherwise returns g in w's dtype for autograd to accumulate.
torch::Tensor deliver_weight_grad(const torch::Tensor& w, const torch::Tensor& g) {
  const torch::Tensor& buf = w.grad();
  if (!torch::GradMode::is_enabled() && w.is_leaf() && buf.defined() && buf.is_contiguous() &&
      buf.sizes() == w.sizes()) {
    buf.add_(g);
    return {};
  }
  return g.to(w.scalar_type());
}

// All experts of a layer over rows xs [M, D] grouped by slot (offs [E] int32: end row of each
// slot's group). y = W2_s (silu(W1_s x) * (V1_s x)) for the rows of slot s, as
//   gu = xs @ [W1; V1]_s^T   (one grouped GEMM for gate and up)   a = silu(g) * u
//   y  = a @ W2_s^T
// Backward: da = dy @ W2_s, the SwiGLU derivative, dx = [dg, du] @ [W1; V1]_s, and the weight
// gradients of the trainable slots [0, n) only: d[W1; V1]_s = [dg, du]_s^T x_s and
// dW2_s = dy_s^T a_s (2d x 2d grouped GEMMs over the first n groups; rows of frozen slots are
// never read). Saves xs and gu (a is recomputed). `leaves` holds w1, v1, w2 of slots 0..n-1 (the
// autograd leaves that receive those gradients).
struct GroupedExpertsFn : public torch::autograd::Function<GroupedExpertsFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& xs,
                               const torch::Tensor& w13, const torch::Tensor& w2,
                               const torch::Tensor& offs, at::TensorList leaves,
                               int64_t n_trainable) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const int64_t F = w2.size(2);
    torch::Tensor gu = at::_grouped_mm(xs, w13.transpose(1, 2), offs);  // [M, 2F]
    torch::Tensor a = at::silu(gu.narrow(1, 0, F)).mul_(gu.narrow(1, F, F));
    torch::Tensor y = at::_grouped_mm(a, w2.transpose(1, 2), offs);      // [M, D]
    bool any_weight_grad = false;
    for (const auto& l : leaves) any_weight_grad = any_weight_grad || l.requires_grad();
    std::vector<torch::Tensor> save = {any_weight_grad ? xs : torch::Tensor(), gu, w13, w2, offs};
    save.insert(save.end(), leaves.begin(), leaves.end());
    ctx->save_for_backward(save);
    ctx->saved_data["n"] = n_trainable;
    return y;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto s = ctx->get_saved_variables();
    const torch::Tensor xs = s[0], gu = s[1], w13 = s[2], w2 = s[3], offs = s[4];
    const int64_t n = ctx->saved_data["n"].toInt();
    const int64_t F = w2.size(2);
    torch::Tensor dy = grads[0].to(gu.scalar_type()).contiguous();
    torch::Tensor g = gu.narrow(1, 0, F), u = gu.narrow(1, F, F);
    torch::Tensor da = at::_grouped_mm(dy, w2, offs);  // [M, F]
    torch::Tensor sg = at::sigmoid(g);
    torch::Tensor silu = g * sg;
    torch::Tensor dgu = torch::empty_like(gu);
    dgu.narrow(1, 0, F).copy_(da * u * sg * (1 + g * (1 - sg)));  // dg
    dgu.narrow(1, F, F).copy_(da * silu);                          // du
    tensor_list out(5 + 3 * n + 1);
    if (ctx->needs_input_grad(0)) out[0] = at::_grouped_mm(dgu, w13, offs);  // [M, D]
    bool need_w = false;
    for (int64_t i = 0; i < 3 * n; ++i) need_w = need_w || ctx->needs_input_grad(4 + i);
    if (n > 0 && need_w) {
      torch::Tensor offs_t = offs.narrow(0, 0, n);
      torch::Tensor d13 = at::_grouped_mm(dgu.t(), xs, offs_t);              // [n, 2F, D]
      torch::Tensor d2 = at::_grouped_mm(dy.t(), silu.mul_(u), offs_t);     // [n, D, F]
      // A slot without rows has a zero gradient (do not rely on a grouped kernel writing its
      // output for an empty group).
      torch::Tensor rows = offs_t - torch::cat({torch::zeros({1}, offs_t.options()),
                                                offs_t.narrow(0, 0, n - 1)});
      torch::Tensor empty = (rows == 0).view({n, 1, 1});
      d13.masked_fill_(empty, 0);
      d2.masked_fill_(empty, 0);
      for (int64_t slot = 0; slot < n; ++slot) {
        const torch::Tensor part[3] = {d13[slot].narrow(0, 0, F), d13[slot].narrow(0, F, F),
                                       d2[slot]};
        for (int64_t j = 0; j < 3; ++j) {
          const int64_t i = 4 + 3 * slot + j;
          if (ctx->needs_input_grad(i)) out[i] = deliver_weight_grad(s[5 + 3 * slot + j], part[j]);
        }
      }
    }
    return out;
  }
};

}  // namespace

torch::Tensor moe_forward_grouped(const torch::Tensor& x, const torch::Tensor& router,
                                  const std::vector<ExpertWeights>& experts,
                                  const ExpertStack& stack, int64_t top_k, bool norm_topk_prob,
                                  RouterStats* stats) {
  expert_stack_refresh(stack, experts);
  const int64_t N = x.size(0), D = x.size(1), E = static_cast<int64_t>(experts.size());
  const int64_t k = top_k;
  // The input in the experts' dtype, once: the router product and the experts share it (under
  // autocast the router product would otherwise keep a bf16 copy of its own).
  const torch::Tensor xc = x.to(stack.dtype());
  torch::Tensor logits =
      torch::matmul(xc, router.t().to(xc.scalar_type()))
          .to(at::promote_types(x.scalar_type(), torch::kFloat32));
  torch::Tensor probs = torch::softmax(logits, -1);
  auto [top_w, top_i] = probs.topk(k, -1);  // [N, k]
  if (norm_topk_prob) top_w = top_w / top_w.sum(-1, /*keepdim=*/true);

  torch::Tensor flat_i = top_i.reshape({-1});                           // expert of each slot
  torch::Tensor key = stack.slot_of_expert.index_select(0, flat_i);     // its compute slot
  // Stable sort: rows grouped by slot, each group in token order (deterministic).
  torch::Tensor order = std::get<1>(key.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  torch::Tensor ones = torch::ones_like(key);
  torch::Tensor rows_per_slot = torch::zeros({E}, key.options()).scatter_add_(0, key, ones);
  torch::Tensor offs = rows_per_slot.cumsum(0).to(torch::kInt32);
  // Row j of the repeated input is token j / k: the gather is a permutation of it, so its
  // backward adds every row once (no atomics over repeated indices), and the k copies of a
  // token are summed by the expand's backward.
  torch::Tensor xs = xc.unsqueeze(1).expand({N, k, D}).reshape({N * k, D}).index_select(0, order);
  std::vector<torch::Tensor> leaves;
  for (int64_t slot = 0; slot < stack.n_trainable; ++slot) {
    const ExpertWeights& e = experts[stack.expert_of_slot[slot]];
    leaves.insert(leaves.end(), {e.w1, e.v1, e.w2});
  }
  torch::Tensor ys = GroupedExpertsFn::apply(xs, stack.w13, stack.w2, offs,
                                             at::TensorList(leaves), stack.n_trainable);
  torch::Tensor slot_w = top_w.reshape({-1}).index_select(0, order);
  torch::Tensor weighted = ys * slot_w.unsqueeze(1);  // fp32
  torch::Tensor inverse = torch::empty_like(order).scatter_(
      0, order, torch::arange(N * k, order.options()));
  torch::Tensor out =
      weighted.index_select(0, inverse).view({N, k, D}).sum(1).to(x.scalar_type());
  if (stats) {
    stats->logits = logits;
    stats->probs = probs;
    stats->counts = torch::zeros({E}, probs.options())
                        .scatter_add_(0, flat_i, torch::ones_like(flat_i, probs.options()));
  }
  return out;
}

}  // namespace spes
