// SPES memory and communication formulas (see transfer_formula.h).
#include "spes/report/transfer_formula.h"

#include "spes/model/memory_estimate.h"
#include "spes/model/param_counts.h"
#include "spes/sync/wire/topk_codec.h"

namespace spes::report {

int64_t TransferFormula::trainable_numel() const {
  return mode == SyncMode::Spes ? shared_numel + own_expert_numel : total_numel();
}

int64_t TransferFormula::grad_and_optimizer_bytes() const {
  return gradient_bytes(trainable_numel()) + adam_moment_bytes(trainable_numel());
}

int64_t TransferFormula::payload_bytes(int64_t numel, bool averaged) const {
  switch (compression) {
    case Compression::Bf16: return 2 * numel;
    case Compression::Int8: return numel + 4 * ((numel + 255) / 256);
    case Compression::Topk:
      return static_cast<int64_t>(
          sync::topk_expected_bytes(numel, sync::TopkParams{averaged ? topk_down_density
                                                                     : topk_density,
                                                            topk_bits}));
    default: return value_bytes * numel;
  }
}

int64_t TransferFormula::upload_bytes() const {
  return mode == SyncMode::Centralized ? 0 : payload_bytes(trainable_numel());
}

int64_t TransferFormula::download_bytes() const {
  if (mode == SyncMode::Centralized) return 0;
  // SPES: the averaged shared tensors, and the other owners' experts as they uploaded them.
  if (mode == SyncMode::Spes)
    return payload_bytes(shared_numel, true) + payload_bytes(expert_numel - own_expert_numel);
  return payload_bytes(total_numel(), true);
}

int64_t TransferFormula::download_merge_bytes() const {
  return mode == SyncMode::Centralized ? 0 : payload_bytes(total_numel(), true);
}

TransferFormula transfer_formula(const Config& cfg, int64_t node) {
  TransferFormula f;
  f.mode = cfg.spes_config.mode;
  f.value_bytes = cfg.spes_config.transfer.dtype == TransferDtype::Bf16 ? 2 : 4;
  f.compression = cfg.spes_config.transfer.compression;
  f.topk_density = cfg.spes_config.transfer.topk_density;
  f.topk_bits = static_cast<int>(cfg.spes_config.transfer.topk_bits);
  f.topk_down_density = sync::topk_published_params(cfg.spes_config.transfer).density;
  const ParamCounts c = param_counts(cfg, node);
  f.shared_numel = c.shared;
  f.expert_numel = c.experts;
  f.own_expert_numel = f.mode == SyncMode::Spes ? c.own_experts : c.experts;
  return f;
}

}  // namespace spes::report
