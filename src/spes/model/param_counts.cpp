// Parameter counts in closed form (see param_counts.h).
#include "spes/model/param_counts.h"

#include "spes/model/ownership.h"
#include "spes/model/registry.h"

namespace spes {
namespace {

// Values of one block's shared tensors (attention, its QK-norm, the two RMSNorms, and the
// router of an MoE block or the MLP of a dense one) and of one expert (gate, up, down).
struct BlockValues {
  int64_t shared = 0;
  int64_t expert = 0;
};

BlockValues block_values(const ModelConfig& m) {
  const int64_t D = m.d_model, F = m.ffn_hidden_size(), Dkv = m.kv_heads() * m.head_dim();
  const int64_t attention = 2 * D * D + 2 * Dkv * D;  // q and o: D x D; k and v: Dkv x D
  const int64_t qk_norm = m.qk_norm == QkNorm::PerHead ? 2 * m.head_dim()
                          : m.qk_norm == QkNorm::Whole ? D + Dkv
                                                       : 0;
  const int64_t norms = 2 * D;  // before attention and before the MLP
  BlockValues b;
  b.expert = 3 * F * D;
  b.shared = attention + qk_norm + norms + (m.is_moe() ? m.moe_num_experts * D : b.expert);
  return b;
}

}  // namespace

ParamCounts param_counts(const Config& cfg, int64_t node) {
  const ModelConfig& m = cfg.model;
  const BlockValues block = block_values(m);
  const int64_t E = m.is_moe() ? m.moe_num_experts : 0;
  ParamCounts c;
  // Embeddings and LM head (embedding rows x D each), the final norm, the blocks.
  c.shared = 2 * m.embedding_rows() * m.d_model + m.d_model + m.n_layers * block.shared;
  c.experts = m.n_layers * E * block.expert;
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
  c.own_experts = owned * block.expert;
  c.trainable = c.shared + trained * block.expert;
  // A token uses top_k of the E experts of every MoE layer.
  c.active_per_token = c.shared + (E > 0 ? c.experts / E * m.moe_top_k : c.experts);
  return c;
}

}  // namespace spes
