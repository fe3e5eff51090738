// Parameter counts in closed form (see param_counts.h).
#include "spes/model/param_counts.h"

#include "spes/common/error.h"
#include "spes/model/ownership.h"
#include "spes/model/registry.h"

namespace spes {
namespace {

// Values of one block's shared tensors (attention, its QK-norm, the two RMSNorms, and the
// router of an MoE block or the MLP of a dense one) and of one expert (gate, up, down).
// In double: exact for every model that can be built, and no overflow for one that cannot.
struct BlockValues {
  double shared = 0;
  double expert = 0;
};

BlockValues block_values(const ModelConfig& m) {
  const double D = static_cast<double>(m.d_model), F = static_cast<double>(m.ffn_hidden_size());
  const double Dkv = static_cast<double>(m.kv_heads()) * static_cast<double>(m.head_dim());
  const double attention = 2 * D * D + 2 * Dkv * D;  // q and o: D x D; k and v: Dkv x D
  const double qk_norm = m.qk_norm == QkNorm::PerHead ? 2.0 * static_cast<double>(m.head_dim())
                         : m.qk_norm == QkNorm::Whole ? D + Dkv
                                                      : 0.0;
  const double norms = 2 * D;  // before attention and before the MLP
  BlockValues b;
  b.expert = 3 * F * D;
  b.shared = attention + qk_norm + norms +
             (m.is_moe() ? static_cast<double>(m.moe_num_experts) * D : b.expert);
  return b;
}

// Embeddings and LM head (embedding rows x D each), the final norm, the blocks' shared values.
double shared_values(const ModelConfig& m, const BlockValues& block) {
  const double D = static_cast<double>(m.d_model);
  return 2 * static_cast<double>(m.embedding_rows()) * D + D +
         static_cast<double>(m.n_layers) * block.shared;
}

double expert_values(const ModelConfig& m, const BlockValues& block) {
  const double E = m.is_moe() ? static_cast<double>(m.moe_num_experts) : 0.0;
  return static_cast<double>(m.n_layers) * E * block.expert;
}

}  // namespace

double model_values(const ModelConfig& m) {
  const BlockValues block = block_values(m);
  return shared_values(m, block) + expert_values(m, block);
}

ParamCounts param_counts(const Config& cfg, int64_t node) {
  const ModelConfig& m = cfg.model;
  const BlockValues block = block_values(m);
  const int64_t E = m.is_moe() ? m.moe_num_experts : 0;
  ParamCounts c;
  c.shared = static_cast<int64_t>(shared_values(m, block));
  c.experts = static_cast<int64_t>(expert_values(m, block));
  c.total = c.shared + c.experts;
  // The registry's map and table (with their checks of the settings).
  const Ownership ownership = Ownership::from_config(cfg);
  const auto trainable = trainable_expert_table(cfg, ownership, node);
  int64_t owned = 0, trained = 0;
  for (int64_t l = 0; l < m.n_layers; ++l)
    for (int64_t e = 0; e < E; ++e) {
      owned += ownership.owner(l, e) == node;
      trained += trainable[l][e];
    }
  const int64_t expert = static_cast<int64_t>(block.expert);
  c.own_experts = owned * expert;
  c.trainable = c.shared + trained * expert;
  // A token uses top_k of the E experts of every MoE layer.
  c.active_per_token = c.shared + (E > 0 ? c.experts / E * m.moe_top_k : c.experts);
  return c;
}

ParamCounts param_counts_training(const Config& cfg, int64_t experts_per_layer) {
  const ModelConfig& m = cfg.model;
  const BlockValues block = block_values(m);
  const int64_t E = m.is_moe() ? m.moe_num_experts : 0;
  SPES_CHECK(experts_per_layer >= 0 && experts_per_layer <= E, "a node of this model trains "
             "between 0 and {} experts per layer, not {}", E, experts_per_layer);
  ParamCounts c;
  c.shared = static_cast<int64_t>(shared_values(m, block));
  c.experts = static_cast<int64_t>(expert_values(m, block));
  c.total = c.shared + c.experts;
  c.own_experts = m.n_layers * experts_per_layer * static_cast<int64_t>(block.expert);
  c.trainable = c.shared + c.own_experts;
  c.active_per_token = c.shared + (E > 0 ? c.experts / E * m.moe_top_k : c.experts);
  return c;
}

}  // namespace spes
