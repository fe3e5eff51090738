// Parameter counts from the meta-device model and the registry (see param_counts.h).
#include "spes/report/param_counts.h"

#include "spes/model/transformer.h"
#include "spes/model/ownership.h"
#include "spes/model/registry.h"

namespace spes::report {

ParamCounts param_counts(const Config& cfg, int64_t node) {
  torch::NoGradGuard no_grad;
  const Transformer model(cfg.model, torch::Device(torch::kMeta));
  const ParamRegistry reg(model, cfg, Ownership::from_config(cfg), node);
  ParamCounts c;
  for (const auto& e : reg.entries()) {
    const int64_t n = e.tensor.numel();
    c.total += n;
    if (e.role == ParamRole::Shared) {
      c.shared += n;
    } else {
      c.experts += n;
      if (e.owner == node) c.own_experts += n;
    }
    if (e.trainable) c.trainable += n;
  }
  // Every expert of a layer has the same shape, and a token uses top_k of the E experts of
  // every MoE layer.
  const ModelConfig& m = cfg.model;
  c.active_per_token =
      c.shared + (m.is_moe() ? c.experts / m.moe_num_experts * m.moe_top_k : c.experts);
  return c;
}

}  // namespace spes::report
