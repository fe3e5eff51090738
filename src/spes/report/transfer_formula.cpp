// SPES memory and communication formulas (see transfer_formula.h).
#include "spes/report/transfer_formula.h"

#include "spes/model/ownership.h"
#include "spes/model/registry.h"
#include "spes/model/transformer.h"

namespace spes::report {

int64_t TransferFormula::trainable_numel() const {
  return mode == "spes" ? shared_numel + own_expert_numel : total_numel();
}

int64_t TransferFormula::upload_bytes() const {
  if (mode == "centralized") return 0;
  return value_bytes * trainable_numel();
}

int64_t TransferFormula::download_bytes() const {
  if (mode == "centralized") return 0;
  return value_bytes * (mode == "spes" ? total_numel() - own_expert_numel : total_numel());
}

int64_t TransferFormula::download_merge_bytes() const {
  return mode == "centralized" ? 0 : value_bytes * total_numel();
}

TransferFormula transfer_formula(const Config& cfg, int64_t node) {
  TransferFormula f;
  f.mode = cfg.spes_config.mode;
  f.value_bytes = cfg.spes_config.transfer_dtype == "bf16" ? 2 : 4;
  torch::NoGradGuard no_grad;
  const Transformer model(cfg.model);
  const Ownership own = Ownership::from_config(cfg);
  const ParamRegistry reg(model, cfg, own, node);
  for (const auto& e : reg.entries()) {
    if (e.role == ParamRole::Shared) {
      f.shared_numel += e.tensor.numel();
    } else {
      f.expert_numel += e.tensor.numel();
      if (e.owner == node) f.own_expert_numel += e.tensor.numel();
    }
  }
  if (f.mode != "spes") f.own_expert_numel = f.expert_numel;
  return f;
}

}  // namespace spes::report
