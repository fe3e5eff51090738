// Node memory by part (see memory_estimate.h).
#include "spes/model/memory_estimate.h"

#include <algorithm>

#include "spes/model/losses.h"
#include "spes/model/runtime_layout.h"

namespace spes {

int64_t moment_bytes(int64_t numel, MomentDtype dtype) {
  switch (dtype) {
    case MomentDtype::Fp32: return 8 * numel;
    case MomentDtype::Bf16: return 4 * numel;
    case MomentDtype::Int8: return 2 * numel + 2 * 4 * ((numel + kMomentBlock - 1) / kMomentBlock);
  }
  return 8 * numel;
}

ActivationShape activation_shape(const Config& cfg) {
  const ModelConfig& m = cfg.model;
  ActivationShape s;
  s.micro_batch = cfg.device_train_microbatch_size;
  s.seq = m.max_sequence_length;
  s.d_model = m.d_model;
  s.layers = m.n_layers;
  s.heads = m.n_heads;
  s.kv_heads = m.kv_heads();
  s.experts = m.is_moe() ? m.moe_num_experts : 0;
  s.top_k = m.is_moe() ? m.moe_top_k : 1;
  s.ffn_hidden = m.ffn_hidden_size();
  s.vocab = m.embedding_rows();
  // "auto" trains in bf16 autocast on a GPU and in fp32 on a CPU; counted as fp32 here.
  s.value_bytes = cfg.precision == Precision::AmpBf16 ? 2 : 4;
  s.checkpoint_every = cfg.activation_checkpointing.every();
  // fp32 on CPU uses the fused head kernel; amp_bf16 the chunked one (model/losses.h).
  if (cfg.precision == Precision::AmpBf16)
    s.logits_chunk_rows = lm_head_default_chunk_rows(s.vocab);
  return s;
}

int64_t activation_bytes(const ActivationShape& s) {
  const int64_t N = s.micro_batch * s.seq, D = s.d_model, H = s.heads;
  const int64_t Dkv = s.kv_heads * (D / H), E = s.experts, k = s.top_k, F = s.ffn_hidden;
  const int64_t attention = 5 * D + 3 * Dkv + H + 1;
  const int64_t ffn = 2 * D + 1 + 2 * E + k * (2 * D + 3 * F);
  const int64_t head = 2 * D + 1;
  const int64_t block = attention + ffn;
  const int64_t ckpt = s.checkpoint_every > 0
                           ? (s.layers + s.checkpoint_every - 1) / s.checkpoint_every : 0;
  const int64_t per_token = (s.layers - ckpt) * block + ckpt * D + (ckpt > 0 ? block : 0) + head;
  const int64_t logit_rows =
      s.logits_chunk_rows > 0 ? std::min(N, s.logits_chunk_rows) : N;
  const int64_t logits = 2 * s.vocab * 4;  // fp32 logits and their softmax / gradient
  return N * per_token * s.value_bytes + logit_rows * logits;
}

int64_t NodeMemory::weights() const {
  int64_t w = 0;
  for (const auto& [dtype, bytes] : weights_by_dtype) w += bytes;
  return w;
}

int64_t NodeMemory::total() const {
  return weights() + gradients + adam_moments + activations + sync_state;
}

NodeMemory node_memory(const Config& cfg, const ParamCounts& counts) {
  NodeMemory m;
  // The trainer's layout decision, on a device where amp_bf16 means bf16 ("auto" counts as fp32).
  const ModelRuntime rt = model_runtime_for(cfg, torch::Device(torch::kCPU), {});
  const int64_t frozen = counts.total - counts.trainable;  // frozen expert values
  const bool frozen_bf16 = rt.frozen_dtype == torch::kBFloat16;
  m.weights_by_dtype["fp32"] = 4 * (counts.total - (frozen_bf16 ? frozen : 0));
  if (cfg.precision == Precision::AmpBf16) {
    m.weights_by_dtype["bf16"] = 2 * counts.total;
    // Experts in the grouped layout keep their bf16 stack between steps; everything else is
    // copied by autocast during a step.
    m.autocast_copies = 2 * (rt.grouped() ? counts.total - counts.experts : counts.total);
  }
  m.gradients = gradient_bytes(counts.trainable);
  m.adam_moments = adam_moment_bytes(counts.trainable, cfg.optimizer.moment_dtype);
  m.activations = activation_bytes(activation_shape(cfg));
  const SpesConfig& s = cfg.spes_config;
  if (s.mode != SyncMode::Centralized) {
    if (s.transfer.compression != Compression::None) m.sync_state += 8 * counts.trainable;
    if (s.timing.overlap)  // the copy of the master weights (frozen ones in their storage dtype) + S
      m.sync_state += m.weights_by_dtype.at("fp32") + (frozen_bf16 ? 2 * frozen : 0) +
                      4 * counts.trainable;
  }
  return m;
}

NodeMemory node_memory_training(const Config& cfg, int64_t experts_per_layer,
                                Precision precision) {
  Config at = cfg;
  at.precision = precision;
  return node_memory(at, param_counts_training(at, experts_per_layer));
}

int64_t experts_within_memory(const Config& cfg, double bytes, Precision precision) {
  const int64_t E = cfg.model.is_moe() ? cfg.model.moe_num_experts : 0;
  int64_t k = -1;
  while (k < E &&
         static_cast<double>(node_memory_training(cfg, k + 1, precision).total()) <= bytes)
    ++k;
  return k;
}

}  // namespace spes
