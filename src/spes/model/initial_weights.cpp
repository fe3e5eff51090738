// Starting weights as data (see initial_weights.h).
#include "spes/model/initial_weights.h"

#include "spes/common/error.h"

namespace spes {

void check_same_architecture(const ModelConfig& run, const ModelConfig& src,
                             const std::string& origin) {
  auto same = [&](const char* key, const auto& a, const auto& b) {
    SPES_CHECK(a == b, "{}: model.{} is {} in this run's config but {} in the initial weights; "
               "the architecture must match (set model.{} to {})", origin, key, a, b, key, b);
  };
  same("block_type", run.block_type, src.block_type);
  same("d_model", run.d_model, src.d_model);
  same("n_layers", run.n_layers, src.n_layers);
  same("n_heads", run.n_heads, src.n_heads);
  same("n_kv_heads", run.kv_heads(), src.kv_heads());
  // The shapes, whichever keys give them: F via mlp_hidden_size or mlp_ratio (reported as
  // mlp_hidden_size = 2F), the table's rows via vocab_size or embedding_size.
  same("mlp_hidden_size", run.swiglu_input_size(), src.swiglu_input_size());
  same("embedding_size", run.embedding_rows(), src.embedding_rows());
  same("qk_norm", run.qk_norm, src.qk_norm);
  same("rope_theta", run.rope_theta, src.rope_theta);
  same("layer_norm_eps", run.layer_norm_eps, src.layer_norm_eps);
  if (run.is_moe()) {
    same("moe_num_experts", run.moe_num_experts, src.moe_num_experts);
    same("moe_top_k", run.moe_top_k, src.moe_top_k);
    same("moe_norm_topk_prob", run.moe_norm_topk_prob, src.moe_norm_topk_prob);
  }
}

}  // namespace spes
