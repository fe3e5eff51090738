// Loss terms (see losses.h). All reductions are in fp32.
#include "spes/model/losses.h"

namespace spes {

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
  torch::Tensor logits = torch::matmul(h, model.lm_head().t());
  torch::Tensor tg = targets.reshape({-1}).to(logits.device());
  LossTerms t;
  auto [ce, z] = lm_losses(logits, tg);
  t.ce = ce;
  t.z = z * cfg.z_loss_weight;
  auto dev = logits.device();
  t.lb = cfg.is_moe() ? load_balancing_loss(fr.routers, cfg.moe_top_k) * cfg.moe_loss_weight
                      : torch::zeros({}, torch::TensorOptions().device(dev));
  t.router_z = cfg.is_moe() ? router_z_loss(fr.routers) * cfg.moe_zloss_weight
                            : torch::zeros({}, torch::TensorOptions().device(dev));
  t.total = t.ce + t.z + t.lb + t.router_z;
  t.n_targets = (tg >= 0).sum().item<int64_t>();
  return t;
}

}  // namespace spes
