// The SwiGLU expert and the dropless top-k MoE layer. Tokens are sorted by expert once; each
// expert multiplies the contiguous block of its tokens (one GEMM per projection, no per-token
// loop), and one index_add scatters the weighted outputs back. Frozen experts (no
// requires_grad) still pass gradients to their inputs.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "spes/model/kernel_parallel.h"
#include "spes/model/layers.h"

namespace spes {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// SwiGLU backward in one pass given s = sigmoid(g) (computed by torch's vectorised kernel):
// da becomes dg = da * u * s * (1 + g (1 - s)), s becomes du = da * silu(g), and a (optional)
// gets the recomputed product silu(g) * u for the down projection's weight gradient.
template <typename T>
void swiglu_bwd(const T* g, const T* u, T* s_du, T* da_dg, T* a, int64_t n) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T gi = g[i], ui = u[i], dai = da_dg[i], si = s_du[i];
      const T silu = gi * si;
      if (a) a[i] = silu * ui;
      da_dg[i] = dai * ui * si * (T(1) + gi * (T(1) - si));
      s_du[i] = dai * silu;
    }
  });
}

// Weight gradient a b (a [r, k], b [k, c]) of weight w. When w already has a gradient buffer
// (persistent gradients, or an earlier micro-batch) and backward is first-order, the product is
// added into that buffer by the GEMM itself, which is what AccumulateGrad would do with a
// returned gradient but without the temporary and the extra pass over it; nothing is returned
// then. Otherwise the product is returned for autograd to accumulate.
torch::Tensor weight_grad(const torch::Tensor& w, const torch::Tensor& a, const torch::Tensor& b) {
  const torch::Tensor& g = w.grad();
  if (!torch::GradMode::is_enabled() && w.is_leaf() && g.defined() && g.is_contiguous() &&
      g.sizes() == w.sizes() && g.scalar_type() == a.scalar_type()) {
    w.mutable_grad().addmm_(a, b);
    return {};
  }
  return torch::mm(a, b);
}

// One SwiGLU expert y = W2 (silu(W1 x) * (V1 x)) as a single autograd node: the three GEMMs of
// the forward and five of the backward, with the derivative of silu(g) * u fused into one
// pass. Saves x, g = W1 x and u = V1 x only (the product is recomputed in backward); weight
// gradients are computed only for weights that require them (frozen experts skip them).
struct SwiGLUFn : public torch::autograd::Function<SwiGLUFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x_,
                               const torch::Tensor& w1, const torch::Tensor& v1,
                               const torch::Tensor& w2) {
    torch::Tensor x = x_.contiguous();
    torch::Tensor g = torch::mm(x, w1.t());
    torch::Tensor u = torch::mm(x, v1.t());
    torch::Tensor a = at::silu(g).mul_(u);
    torch::Tensor y = torch::mm(a, w2.t());
    ctx->save_for_backward({x, w1, v1, w2, g, u});
    return y;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto s = ctx->get_saved_variables();
    torch::Tensor x = s[0], w1 = s[1], v1 = s[2], w2 = s[3], g = s[4], u = s[5];
    torch::Tensor dy = grads[0].contiguous();
    const bool need_dw2 = ctx->needs_input_grad(3);
    torch::Tensor da = torch::mm(dy, w2);                      // [n, F], becomes dg
    torch::Tensor du = at::sigmoid(g);                         // becomes du
    torch::Tensor a = need_dw2 ? torch::empty_like(g) : torch::Tensor();
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "swiglu_bwd", [&] {
      swiglu_bwd(g.data_ptr<scalar_t>(), u.data_ptr<scalar_t>(), du.data_ptr<scalar_t>(),
                 da.data_ptr<scalar_t>(),
                 need_dw2 ? a.data_ptr<scalar_t>() : static_cast<scalar_t*>(nullptr), g.numel());
    });
    const torch::Tensor& dg = da;
    torch::Tensor dx, dw1, dv1, dw2;
    if (ctx->needs_input_grad(0)) dx = torch::mm(dg, w1).addmm_(du, v1);
    if (ctx->needs_input_grad(1)) dw1 = weight_grad(w1, dg.t(), x);
    if (ctx->needs_input_grad(2)) dv1 = weight_grad(v1, du.t(), x);
    if (need_dw2) dw2 = weight_grad(w2, dy.t(), a);
    return {dx, dw1, dv1, dw2};
  }
};

// Splits the experts with tokens into `bins` groups of about equal work (tokens), largest
// first onto the least loaded bin; each group is one task of at::parallel_for.
std::vector<std::vector<int64_t>> balance(const std::vector<int64_t>& counts, int64_t bins) {
  std::vector<int64_t> order;
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e)
    if (counts[e] > 0) order.push_back(e);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return counts[a] > counts[b]; });
  bins = std::max<int64_t>(1, std::min<int64_t>(bins, static_cast<int64_t>(order.size())));
  std::vector<std::vector<int64_t>> out(bins);
  std::vector<int64_t> load(bins, 0);
  for (int64_t e : order) {
    const int64_t b = std::min_element(load.begin(), load.end()) - load.begin();
    out[b].push_back(e);
    load[b] += counts[e];
  }
  return out;
}

// Calls fn(e, first_row, rows) for every expert with rows (rows grouped by expert, in expert
// order), the experts split by `balance` into one task per thread.
template <class F>
void for_each_expert_in_parallel(const std::vector<int64_t>& counts, const F& fn) {
  std::vector<int64_t> start(counts.size() + 1, 0);
  for (size_t e = 0; e < counts.size(); ++e) start[e + 1] = start[e] + counts[e];
  const auto bins = balance(counts, at::get_num_threads());
  const int64_t tasks = static_cast<int64_t>(bins.size());
  parallel_for_in_grad_mode(0, tasks, 1, [&](int64_t bb, int64_t be) {
    for (int64_t b = bb; b < be; ++b)
      for (int64_t e : bins[b]) fn(e, start[e], counts[e]);
  });
}

// All experts of a MoE layer as one autograd node over the rows xs [M, D] grouped by expert
// (counts[e] rows each, in expert order): the experts run concurrently, one per thread, each
// with single-threaded GEMMs (no synchronisation inside a product; a per-expert kernel split
// over two threads pays it in every GEMM), forward and backward; the arithmetic of each expert
// is exactly SwiGLUFn's. weights holds w1, v1, w2 of expert 0, then of expert 1, ...
struct ExpertsFn : public torch::autograd::Function<ExpertsFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& xs_,
                               at::TensorList weights, const std::vector<int64_t>& counts) {
    torch::Tensor xs = xs_.contiguous();
    const int64_t E = static_cast<int64_t>(counts.size()), M = xs.size(0), D = xs.size(1);
    const int64_t F = weights[0].size(0);
    torch::Tensor g = torch::empty({M, F}, xs.options()), u = torch::empty({M, F}, xs.options());
    torch::Tensor ys = torch::empty({M, D}, xs.options());
    for_each_expert_in_parallel(counts, [&](int64_t e, int64_t r0, int64_t n) {
      torch::Tensor x = xs.narrow(0, r0, n), ge = g.narrow(0, r0, n), ue = u.narrow(0, r0, n);
      torch::Tensor ye = ys.narrow(0, r0, n);
      torch::mm_out(ge, x, weights[3 * e].t());
      torch::mm_out(ue, x, weights[3 * e + 1].t());
      torch::Tensor a = at::silu(ge).mul_(ue);
      torch::mm_out(ye, a, weights[3 * e + 2].t());
    });
    // The inputs are only needed for weight gradients: with frozen experts keep just the rows
    // of the trainable ones (row offsets in xoff; -1: not kept).
    std::vector<int64_t> xoff(E, -1);
    std::vector<torch::Tensor> kept;
    int64_t rows = 0;
    for (int64_t e = 0, first = 0; e < E; first += counts[e], ++e) {
      if (counts[e] == 0 || !(weights[3 * e].requires_grad() || weights[3 * e + 1].requires_grad()))
        continue;
      xoff[e] = rows;
      rows += counts[e];
      kept.push_back(xs.narrow(0, first, counts[e]));
    }
    torch::Tensor xkeep = rows == M ? xs : rows == 0 ? torch::empty({0, D}, xs.options())
                                                     : torch::cat(kept, 0);
    std::vector<torch::Tensor> save = {xkeep, g, u};
    save.insert(save.end(), weights.begin(), weights.end());
    ctx->save_for_backward(save);
    ctx->saved_data["counts"] = c10::List<int64_t>(counts);
    ctx->saved_data["xoff"] = c10::List<int64_t>(xoff);
    return ys;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto s = ctx->get_saved_variables();
    torch::Tensor xkeep = s[0], g = s[1], u = s[2];
    auto cl = ctx->saved_data["counts"].toIntList();
    std::vector<int64_t> counts(cl.begin(), cl.end());
    auto xl = ctx->saved_data["xoff"].toIntList();
    std::vector<int64_t> xoff(xl.begin(), xl.end());
    const int64_t E = static_cast<int64_t>(counts.size());
    torch::Tensor dys = grads[0].contiguous();
    const bool need_dx = ctx->needs_input_grad(0);
    torch::Tensor dxs = need_dx ? torch::empty({g.size(0), xkeep.size(1)}, g.options())
                                : torch::Tensor();
    tensor_list out(1 + 3 * E + 1);
    for_each_expert_in_parallel(counts, [&](int64_t e, int64_t r0, int64_t n) {
      const torch::Tensor &w1 = s[3 + 3 * e], &v1 = s[4 + 3 * e], &w2 = s[5 + 3 * e];
      torch::Tensor ge = g.narrow(0, r0, n), ue = u.narrow(0, r0, n);
      torch::Tensor x = xoff[e] >= 0 ? xkeep.narrow(0, xoff[e], n) : torch::Tensor();
      torch::Tensor dy = dys.narrow(0, r0, n);
      const bool need_dw2 = ctx->needs_input_grad(3 + 3 * e);
      torch::Tensor da = torch::mm(dy, w2);  // becomes dg
      torch::Tensor du = at::sigmoid(ge);    // becomes du
      torch::Tensor a = need_dw2 ? torch::empty_like(ge) : torch::Tensor();
      AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "experts_bwd", [&] {
        swiglu_bwd(ge.data_ptr<scalar_t>(), ue.data_ptr<scalar_t>(), du.data_ptr<scalar_t>(),
                   da.data_ptr<scalar_t>(),
                   need_dw2 ? a.data_ptr<scalar_t>() : static_cast<scalar_t*>(nullptr),
                   ge.numel());
      });
      if (need_dx) {
        torch::Tensor dx = dxs.narrow(0, r0, n);
        torch::mm_out(dx, da, w1);
        dx.addmm_(du, v1);
      }
      if (ctx->needs_input_grad(1 + 3 * e)) out[1 + 3 * e] = weight_grad(w1, da.t(), x);
      if (ctx->needs_input_grad(2 + 3 * e)) out[2 + 3 * e] = weight_grad(v1, du.t(), x);
      if (need_dw2) out[3 + 3 * e] = weight_grad(w2, dy.t(), a);
    });
    out[0] = dxs;
    return out;
  }
};

}  // namespace

torch::Tensor expert_forward_reference(const ExpertWeights& e, const torch::Tensor& x) {
  torch::Tensor g = torch::matmul(x, e.w1.t());
  torch::Tensor u = torch::matmul(x, e.v1.t());
  return torch::matmul(torch::silu(g) * u, e.w2.t());
}

torch::Tensor expert_forward(const ExpertWeights& e, const torch::Tensor& x) {
  if (x.dim() == 2 && fused_cpu_kernel_ok({x, e.w1, e.v1, e.w2}))
    return SwiGLUFn::apply(x, e.w1, e.v1, e.w2);
  return expert_forward_reference(e, x);
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
  torch::Tensor ys;
  std::vector<torch::Tensor> weights;
  for (const auto& e : experts) weights.insert(weights.end(), {e.w1, e.v1, e.w2});
  std::vector<torch::Tensor> all = weights;
  all.push_back(x);
  if (x.dim() == 2 && fused_cpu_kernel_ok(all)) {
    ys = ExpertsFn::apply(xs, at::TensorList(weights), std::vector<int64_t>(c, c + E));
  } else {
    std::vector<torch::Tensor> outs;
    outs.reserve(E);
    int64_t start = 0;
    for (int64_t e = 0; e < E; ++e) {
      if (c[e] == 0) continue;
      outs.push_back(expert_forward(experts[e], xs.narrow(0, start, c[e])));
      start += c[e];
    }
    ys = torch::cat(outs, 0);
  }
  ys = ys * slot_w.unsqueeze(1);                                   // [N*k, D]
  torch::Tensor out = torch::zeros_like(x).index_add(0, token_of_slot, ys);
  if (stats) {
    stats->logits = logits;
    stats->probs = probs;
    stats->counts = counts.to(torch::kFloat32);
  }
  return out;
}

}  // namespace spes
