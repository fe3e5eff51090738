// Hugging Face config.json <-> ModelConfig (see hf_config.h; mapping table in docs/INTEROP.md).
#include "spes/interop/hf_config.h"

#include <cmath>

#include "spes/common/error.h"

namespace spes {

using json = nlohmann::json;

HfArchitecture hf_architecture_for(const ModelConfig& m) {
  if (m.is_moe()) {
    if (m.qk_norm == QkNorm::Whole) return {"OlmoeForCausalLM", "olmoe"};
    if (m.qk_norm == QkNorm::PerHead) return {"Qwen3MoeForCausalLM", "qwen3_moe"};
    fail("model.qk_norm is '{}' with model.block_type 'moe': no transformers MoE class without "
         "QK-norm computes this model (OLMoE needs qk_norm whole, Qwen3-MoE per_head)",
         m.qk_norm);
  }
  if (m.qk_norm == QkNorm::PerHead) return {"Qwen3ForCausalLM", "qwen3"};
  if (m.qk_norm == QkNorm::None) return {"LlamaForCausalLM", "llama"};
  fail("model.qk_norm is 'whole' with model.block_type 'dense': no transformers class computes "
       "this model (OLMo-2 has whole-vector QK-norm but normalises after each sub-layer); use "
       "qk_norm per_head (Qwen3) or none (Llama) for dense models");
}

static json token_id_or_null(int64_t id) { return id >= 0 ? json(id) : json(nullptr); }

json hf_config_from_model(const ModelConfig& m, const std::string& torch_dtype) {
  const HfArchitecture a = hf_architecture_for(m);
  json j;
  j["architectures"] = {a.architecture};
  j["model_type"] = a.model_type;
  j["vocab_size"] = m.embedding_rows();  // transformers' vocab_size is the table's rows
  j["hidden_size"] = m.d_model;
  j["intermediate_size"] = m.ffn_hidden_size();
  j["num_hidden_layers"] = m.n_layers;
  j["num_attention_heads"] = m.n_heads;
  j["num_key_value_heads"] = m.kv_heads();
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = m.max_sequence_length;
  j["initializer_range"] = m.init_std;
  j["rms_norm_eps"] = m.layer_norm_eps;
  j["use_cache"] = true;
  j["tie_word_embeddings"] = false;
  j["rope_theta"] = m.rope_theta;
  j["rope_scaling"] = nullptr;
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["bos_token_id"] = nullptr;
  j["eos_token_id"] = token_id_or_null(m.eos_token_id);
  j["pad_token_id"] = token_id_or_null(m.pad_token_id);
  j["torch_dtype"] = torch_dtype;
  if (a.model_type != "olmoe") j["head_dim"] = m.head_dim();
  if (m.is_moe()) {
    j["num_experts"] = m.moe_num_experts;
    j["num_experts_per_tok"] = m.moe_top_k;
    j["norm_topk_prob"] = m.moe_norm_topk_prob;
    j["output_router_logits"] = false;
    j["router_aux_loss_coef"] = m.moe_loss_weight;
  }
  if (a.model_type == "olmoe") j["clip_qkv"] = nullptr;
  if (a.model_type == "qwen3_moe") {
    j["moe_intermediate_size"] = m.ffn_hidden_size();
    j["decoder_sparse_step"] = 1;
    j["mlp_only_layers"] = json::array();
  }
  if (a.model_type == "qwen3_moe" || a.model_type == "qwen3") {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = m.n_layers;
  }
  if (a.model_type == "llama") {
    j["mlp_bias"] = false;
    j["pretraining_tp"] = 1;
  }
  return j;
}

namespace {

// Typed access to config.json keys with errors that name the file, key, expected and found.
struct HfConfigReader {
  const json& j;
  const std::string& origin;

  bool has(const char* k) const { return j.contains(k) && !j.at(k).is_null(); }
  int64_t integer(const char* k) const {
    SPES_CHECK(has(k), "{}: required key '{}' is missing", origin, k);
    SPES_CHECK(j.at(k).is_number_integer(), "{}: '{}' must be an integer, found {}", origin, k,
               j.at(k).dump());
    return j.at(k).get<int64_t>();
  }
  int64_t integer(const char* k, int64_t dflt) const { return has(k) ? integer(k) : dflt; }
  double number(const char* k, double dflt) const {
    if (!has(k)) return dflt;
    SPES_CHECK(j.at(k).is_number(), "{}: '{}' must be a number, found {}", origin, k,
               j.at(k).dump());
    return j.at(k).get<double>();
  }
  bool boolean(const char* k, bool dflt) const {
    if (!has(k)) return dflt;
    SPES_CHECK(j.at(k).is_boolean(), "{}: '{}' must be true or false, found {}", origin, k,
               j.at(k).dump());
    return j.at(k).get<bool>();
  }
  std::string string(const char* k, const std::string& dflt) const {
    if (!has(k)) return dflt;
    SPES_CHECK(j.at(k).is_string(), "{}: '{}' must be a string, found {}", origin, k,
               j.at(k).dump());
    return j.at(k).get<std::string>();
  }
  // A key whose value our model cannot represent: one error naming key, value and why.
  void refuse_if(bool cond, const char* k, const std::string& why) const {
    SPES_CHECK(!cond, "{}: '{}' is {}; {}", origin, k, j.contains(k) ? j.at(k).dump() : "unset",
               why);
  }
};

// The RoPE base, refusing any scaling (llama3, yarn, linear, dynamic, ...): spes applies plain
// rotate-half RoPE. Reads the v4 keys (rope_theta, rope_scaling) and the v5 rope_parameters.
double read_rope_theta(const HfConfigReader& r) {
  double theta = r.number("rope_theta", 10000.0);
  for (const char* k : {"rope_scaling", "rope_parameters"}) {
    if (!r.has(k)) continue;
    const json& s = r.j.at(k);
    SPES_CHECK(s.is_object(), "{}: '{}' must be an object or null, found {}", r.origin, k,
               s.dump());
    const std::string type = s.value("rope_type", s.value("type", std::string("default")));
    SPES_CHECK(type == "default", "{}: '{}.rope_type' is '{}'; spes supports plain RoPE only "
               "(no scaling: rope_type 'default' or rope_scaling null)", r.origin, k, type);
    if (s.contains("rope_theta")) {
      SPES_CHECK(s.at("rope_theta").is_number(), "{}: '{}.rope_theta' must be a number", r.origin,
                 k);
      theta = s.at("rope_theta").get<double>();
    }
    if (s.contains("partial_rotary_factor"))
      SPES_CHECK(s.at("partial_rotary_factor") == 1.0, "{}: '{}.partial_rotary_factor' is {}; "
                 "spes rotates the full head dimension", r.origin, k,
                 s.at("partial_rotary_factor").dump());
  }
  return theta;
}

// model_type, refusing the families whose blocks spes cannot compute.
std::string read_model_type(const HfConfigReader& r) {
  const std::string type = r.string("model_type", "");
  SPES_CHECK(type != "qwen2" && type != "qwen2_moe",
             "{}: 'model_type' is \"{}\"; its attention has biases on q_proj/k_proj/v_proj "
             "(Qwen2Attention always uses bias=True) and spes models have no biases", r.origin,
             type);
  SPES_CHECK(type != "olmo2", "{}: 'model_type' is \"olmo2\"; OLMo-2 normalises the outputs of "
             "attention and MLP (post_attention_layernorm / post_feedforward_layernorm after each "
             "sub-layer) while spes blocks are pre-norm (RMSNorm before each sub-layer)",
             r.origin);
  SPES_CHECK(type == "olmoe" || type == "qwen3_moe" || type == "llama" || type == "qwen3",
             "{}: 'model_type' is \"{}\"; import-hf reads olmoe, qwen3_moe, llama and qwen3 "
             "(qwen2 and olmo2 are refused: attention biases, post-norm blocks)", r.origin, type);
  return type;
}

// The block type and QK-norm of the family, and the sizes: layers, width, heads, vocabulary,
// the expert (or MLP) hidden size and, for MoE families, the experts and their routing.
void read_shape(const HfConfigReader& r, const std::string& type, ModelConfig& m) {
  const bool moe = type == "olmoe" || type == "qwen3_moe";
  m.block_type = moe ? BlockType::Moe : BlockType::Dense;
  m.qk_norm = type == "olmoe" ? QkNorm::Whole : (type == "llama" ? QkNorm::None : QkNorm::PerHead);
  m.d_model = r.integer("hidden_size");
  m.n_layers = r.integer("num_hidden_layers");
  m.n_heads = r.integer("num_attention_heads");
  m.vocab_size = r.integer("vocab_size");
  SPES_CHECK(m.d_model > 0 && m.n_layers > 0 && m.n_heads > 0 && m.vocab_size > 0,
             "{}: hidden_size, num_hidden_layers, num_attention_heads and vocab_size must be "
             "positive", r.origin);
  const int64_t kv = r.integer("num_key_value_heads", m.n_heads);
  m.n_kv_heads = kv == m.n_heads ? 0 : kv;
  SPES_CHECK(m.d_model % m.n_heads == 0, "{}: hidden_size {} is not divisible by "
             "num_attention_heads {}", r.origin, m.d_model, m.n_heads);
  if (r.has("head_dim"))
    SPES_CHECK(r.integer("head_dim") == m.d_model / m.n_heads,
               "{}: 'head_dim' is {} but hidden_size / num_attention_heads is {}; spes derives "
               "the head size from d_model / n_heads (q_proj must be hidden_size x hidden_size)",
               r.origin, r.integer("head_dim"), m.d_model / m.n_heads);
  // transformers' intermediate_size is F; OLMo's mlp_hidden_size is the SwiGLU width 2F.
  m.set_ffn_hidden_size(r.integer(type == "qwen3_moe" ? "moe_intermediate_size"
                                                      : "intermediate_size"));
  if (!moe) return;
  // transformers 5 writes Qwen3-MoE's expert count as num_local_experts, 4.x as num_experts.
  const char* experts_key =
      !r.has("num_experts") && r.has("num_local_experts") ? "num_local_experts" : "num_experts";
  m.moe_num_experts = r.integer(experts_key);
  m.moe_top_k = r.integer("num_experts_per_tok");
  SPES_CHECK(m.moe_num_experts > 0, "{}: '{}' must be positive", r.origin, experts_key);
  m.moe_norm_topk_prob = r.boolean("norm_topk_prob", false);
  m.moe_loss_weight = r.number("router_aux_loss_coef", type == "olmoe" ? 0.01 : 0.001);
}

// The EOS token (the first of a list) and the padding token; true when config.json names an
// EOS token.
bool read_token_ids(const HfConfigReader& r, ModelConfig& m) {
  const bool has_eos = r.has("eos_token_id");
  if (has_eos) {
    const json& e = r.j.at("eos_token_id");
    SPES_CHECK(e.is_number_integer() ||
                   (e.is_array() && !e.empty() && e.at(0).is_number_integer()),
               "{}: 'eos_token_id' must be an integer or a list of integers, found {}", r.origin,
               e.dump());
    m.eos_token_id = e.is_array() ? e.at(0).get<int64_t>() : e.get<int64_t>();
  }
  m.pad_token_id = r.integer("pad_token_id", -1);
  return has_eos;
}

// Everything our model cannot represent, refused by name.
void refuse_unrepresentable(const HfConfigReader& r, const std::string& type) {
  const std::string act = r.string("hidden_act", "silu");
  r.refuse_if(act != "silu" && act != "swish", "hidden_act",
              "spes experts are SwiGLU (silu) MLPs");
  r.refuse_if(r.boolean("attention_bias", false), "attention_bias",
              "spes models have no biases");
  r.refuse_if(r.boolean("mlp_bias", false), "mlp_bias", "spes models have no biases");
  r.refuse_if(r.has("clip_qkv"), "clip_qkv", "spes does not clip q/k/v (must be null)");
  r.refuse_if(r.boolean("use_sliding_window", false), "use_sliding_window",
              "spes attention is full causal attention (no sliding window)");
  r.refuse_if(r.number("partial_rotary_factor", 1.0) != 1.0, "partial_rotary_factor",
              "spes rotates the full head dimension");
  if (r.has("layer_types")) {
    SPES_CHECK(r.j.at("layer_types").is_array(), "{}: 'layer_types' must be a list", r.origin);
    for (const auto& t : r.j.at("layer_types"))
      r.refuse_if(t != "full_attention", "layer_types",
                  "spes attention is full causal attention in every layer");
  }
  if (type == "qwen3_moe") {
    r.refuse_if(r.integer("decoder_sparse_step", 1) != 1, "decoder_sparse_step",
                "spes makes every layer an MoE layer (decoder_sparse_step 1)");
    r.refuse_if(r.has("mlp_only_layers") && !r.j.at("mlp_only_layers").empty(),
                "mlp_only_layers", "spes makes every layer an MoE layer (mlp_only_layers [])");
  }
}

}  // namespace

HfImportedConfig hf_config_to_model(const json& j, const std::string& origin,
                                    int64_t max_seq_len) {
  SPES_CHECK(j.is_object(), "{}: config.json must hold a JSON object", origin);
  const HfConfigReader r{j, origin};
  HfImportedConfig out;
  out.model_type = read_model_type(r);
  ModelConfig& m = out.model;
  read_shape(r, out.model_type, m);
  m.rope_theta = read_rope_theta(r);
  m.layer_norm_eps = r.number("rms_norm_eps", out.model_type == "olmoe" ? 1e-5 : 1e-6);
  m.init_std = r.number("initializer_range", 0.02);
  const int64_t max_pos = r.integer("max_position_embeddings", 2048);
  m.max_sequence_length = max_seq_len > 0 ? max_seq_len : max_pos;
  out.has_eos = read_token_ids(r, m);
  refuse_unrepresentable(r, out.model_type);
  out.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  return out;
}

}  // namespace spes
