// The model's storage layout for a run (see runtime_layout.h).
#include "spes/model/runtime_layout.h"

namespace spes {

bool use_bf16_autocast(const Config& cfg, const torch::Device& device) {
  if (cfg.precision == Precision::Fp32) return false;
  if (cfg.precision == Precision::AmpBf16) return true;  // on CPU too (slow without bf16 units)
  return device.is_cuda();  // auto
}

ModelRuntime model_runtime_for(const Config& cfg, const torch::Device& device,
                               const std::vector<std::vector<bool>>& trainable) {
  ModelRuntime rt;
  rt.checkpoint_every = cfg.activation_checkpointing.every();
  const ModelConfig& m = cfg.model;
  const bool bf16 = use_bf16_autocast(cfg, device);
  const bool shapes_ok = m.d_model % 8 == 0 && m.ffn_hidden_size() % 8 == 0;
  if (!m.is_moe() || !shapes_ok || !(device.is_cuda() || bf16)) return rt;
  rt.grouped_dtype = bf16 ? torch::kBFloat16 : torch::kFloat32;
  rt.trainable_experts = trainable;
  const bool synced = cfg.spes_config.mode != SyncMode::Centralized;
  const bool exact_fp32_weights = synced && cfg.spes_config.transfer.dtype == TransferDtype::Fp32;
  rt.frozen_dtype = bf16 && !exact_fp32_weights ? torch::kBFloat16 : torch::kFloat32;
  return rt;
}

}  // namespace spes
