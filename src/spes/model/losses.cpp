// Loss terms (see losses.h). All reductions are in fp32.
#include "spes/model/losses.h"

#include <ATen/Parallel.h>

#include "spes/common/error.h"
#include "spes/model/layers.h"

namespace spes {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// LM head + cross-entropy + output z-loss as one autograd node: logits = h W^T [N, V] are
// computed, reduced (logsumexp, target logit) and kept; backward turns them in place into
// dlogits = softmax * (g_ce + 2 lse g_z) / n - onehot * g_ce / n (rows without a target: 0)
// and runs the two GEMMs, so no other [N, V] tensor is ever allocated.
struct LMHeadLossFn : public torch::autograd::Function<LMHeadLossFn> {
  static tensor_list forward(AutogradContext* ctx, const torch::Tensor& h,
                             const torch::Tensor& w, const torch::Tensor& targets) {
    torch::Tensor logits = torch::mm(h, w.t());
    torch::Tensor lse = at::logsumexp(logits, 1);                              // [N]
    torch::Tensor valid = targets >= 0;
    torch::Tensor safe_t = targets.clamp_min(0);
    torch::Tensor tgt = logits.gather(1, safe_t.unsqueeze(1)).squeeze(1);    // [N]
    torch::Tensor mask = valid.to(logits.scalar_type());
    torch::Tensor n = mask.sum().clamp_min(1.0);
    torch::Tensor ce = ((lse - tgt) * mask).sum() / n;
    torch::Tensor z = (lse.pow(2) * mask).sum() / n;
    ctx->save_for_backward({h, w});
    ctx->saved_data["logits"] = logits;
    ctx->saved_data["lse"] = lse;
    ctx->saved_data["mask_over_n"] = mask / n;
    ctx->saved_data["targets"] = safe_t;
    return {ce, z};
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    torch::Tensor h = saved[0], w = saved[1];
    SPES_CHECK(ctx->saved_data.count("logits"), "the fused LM-head loss was differentiated "
               "twice (retain_graph is not supported)");
    torch::Tensor logits = ctx->saved_data["logits"].toTensor();
    ctx->saved_data.erase("logits");
    torch::Tensor lse = ctx->saved_data["lse"].toTensor();
    torch::Tensor m = ctx->saved_data["mask_over_n"].toTensor();
    torch::Tensor t = ctx->saved_data["targets"].toTensor();
    torch::Tensor gce = grads[0].defined() ? grads[0] : torch::zeros({}, lse.options());
    torch::Tensor gz = grads[1].defined() ? grads[1] : torch::zeros({}, lse.options());
    torch::Tensor row_ce = m * gce;                                  // [N]
    torch::Tensor row_scale = row_ce + 2.0 * lse * m * gz;          // [N]
    torch::Tensor d = logits;                                        // reused in place
    d.sub_(lse.unsqueeze(1)).exp_().mul_(row_scale.unsqueeze(1));
    d.scatter_add_(1, t.unsqueeze(1), -row_ce.unsqueeze(1));
    torch::Tensor dh, dw;
    if (ctx->needs_input_grad(0)) dh = torch::mm(d, w);
    if (ctx->needs_input_grad(1)) dw = torch::mm(d.t(), h);
    return {dh, dw, torch::Tensor()};
  }
};

}  // namespace

std::pair<torch::Tensor, torch::Tensor> lm_head_losses(const torch::Tensor& h,
                                                       const torch::Tensor& lm_head,
                                                       const torch::Tensor& targets) {
  if (h.dim() == 2 && fused_cpu_kernel_ok({h, lm_head})) {
    auto r = LMHeadLossFn::apply(h, lm_head, targets);
    return {r[0], r[1]};
  }
  return lm_losses(torch::matmul(h, lm_head.t()), targets);
}

std::pair<torch::Tensor, torch::Tensor> lm_losses(const torch::Tensor& logits,
                                                  const torch::Tensor& targets) {
  torch::Tensor lf = logits.to(at::promote_types(logits.scalar_type(), torch::kFloat32));
  torch::Tensor valid = targets >= 0;
  torch::Tensor safe_t = targets.clamp_min(0);
  torch::Tensor lse = torch::logsumexp(lf, -1);                          // [N]
  torch::Tensor tgt = lf.gather(-1, safe_t.unsqueeze(-1)).squeeze(-1);    // [N]
  torch::Tensor mask = valid.to(lf.scalar_type());
  torch::Tensor n = mask.sum().clamp_min(1.0);
  torch::Tensor ce = ((lse - tgt) * mask).sum() / n;
  torch::Tensor z = (lse.pow(2) * mask).sum() / n;
  return {ce, z};
}

torch::Tensor load_balancing_loss(const std::vector<RouterStats>& routers, int64_t top_k) {
  if (routers.empty()) return torch::zeros({});
  const int64_t L = static_cast<int64_t>(routers.size());
  const int64_t E = routers[0].probs.size(1), T = routers[0].probs.size(0);
  torch::Tensor sum = torch::zeros({}, routers[0].probs.options());
  for (const auto& r : routers) sum = sum + (r.counts.detach() * r.probs.mean(0)).sum();
  return sum * (static_cast<double>(E) / (static_cast<double>(L) * T * top_k));
}

torch::Tensor router_z_loss(const std::vector<RouterStats>& routers) {
  if (routers.empty()) return torch::zeros({});
  torch::Tensor sum = torch::zeros({}, routers[0].logits.options());
  for (const auto& r : routers) sum = sum + torch::logsumexp(r.logits, -1).pow(2).mean();
  return sum;
}

LossTerms compute_losses(const Transformer& model, const torch::Tensor& tokens,
                         const torch::Tensor& targets) {
  const ModelConfig& cfg = model.config();
  ForwardResult fr = model.forward(tokens);
  torch::Tensor h = fr.hidden.reshape({-1, cfg.d_model});
  torch::Tensor tg = targets.reshape({-1}).to(h.device());
  LossTerms t;
  torch::Tensor lm_total;
  if (h.dim() == 2 && fused_cpu_kernel_ok({h, model.lm_head()})) {
    auto [ce, z] = lm_head_losses(h, model.lm_head(), tg);
    t.ce = ce;
    t.z = z * cfg.z_loss_weight;
    lm_total = t.ce + t.z;
  } else {  // other devices and dtypes: chunked, no [N, V] fp32 logits
    LmHeadLoss r = lm_head_losses_chunked(h, model.lm_head(), tg, cfg.z_loss_weight);
    t.ce = r.ce;
    t.z = r.z * cfg.z_loss_weight;
    lm_total = r.total;
  }
  auto dev = h.device();
  t.lb = cfg.is_moe() ? load_balancing_loss(fr.routers, cfg.moe_top_k) * cfg.moe_loss_weight
                      : torch::zeros({}, torch::TensorOptions().device(dev));
  t.router_z = cfg.is_moe() ? router_z_loss(fr.routers) * cfg.moe_zloss_weight
                            : torch::zeros({}, torch::TensorOptions().device(dev));
  t.total = lm_total + t.lb + t.router_z;
  t.n_targets = (tg >= 0).sum();
  t.block_inputs = std::move(fr.block_inputs);
  return t;
}

}  // namespace spes
