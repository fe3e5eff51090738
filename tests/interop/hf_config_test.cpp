// config.json mapping: exported keys compared with hand-written expected objects (the
// documented mapping in docs/INTEROP.md, with the key names of transformers'
// configuration_olmoe.py / configuration_qwen3_moe.py), real published configs read back, and
// every refused structural feature named in its error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>

#include "interop/interop_test_util.h"
#include "spes/common/error.h"
#include "spes/interop/hf_config.h"

using namespace spes;
using json = nlohmann::json;
using ::testing::HasSubstr;

namespace {

std::string error_of(const json& j) {
  try {
    hf_config_to_model(j, "cfg/config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(InteropHfConfig, OlmoeKeysMatchTheDocumentedMapping) {
  ModelConfig m = interop_test::tiny("moe", "whole", false, 2);
  m.rope_theta = 10000.0;
  m.pad_token_id = 1;
  const json expected = {
      {"architectures", {"OlmoeForCausalLM"}}, {"model_type", "olmoe"},
      {"vocab_size", 32}, {"hidden_size", 16}, {"intermediate_size", 12},
      {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
      {"hidden_act", "silu"}, {"max_position_embeddings", 8}, {"initializer_range", 0.02},
      {"rms_norm_eps", 1e-6}, {"use_cache", true}, {"tie_word_embeddings", false},
      {"rope_theta", 10000.0}, {"rope_scaling", nullptr}, {"attention_bias", false},
      {"attention_dropout", 0.0}, {"bos_token_id", nullptr}, {"eos_token_id", 3},
      {"pad_token_id", 1}, {"torch_dtype", "float32"}, {"num_experts", 4},
      {"num_experts_per_tok", 2}, {"norm_topk_prob", false}, {"output_router_logits", false},
      {"router_aux_loss_coef", 0.01}, {"clip_qkv", nullptr}};
  EXPECT_EQ(hf_config_from_model(m, "float32"), expected)
      << hf_config_from_model(m, "float32").dump(2);
}

TEST(InteropHfConfig, Qwen3MoeKeysMatchTheDocumentedMapping) {
  ModelConfig m = interop_test::tiny("moe", "per_head", true, 1);
  const json expected = {
      {"architectures", {"Qwen3MoeForCausalLM"}}, {"model_type", "qwen3_moe"},
      {"vocab_size", 32}, {"hidden_size", 16}, {"intermediate_size", 12},
      {"moe_intermediate_size", 12}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
      {"num_key_value_heads", 1}, {"head_dim", 4}, {"hidden_act", "silu"},
      {"max_position_embeddings", 8}, {"initializer_range", 0.02}, {"rms_norm_eps", 1e-6},
      {"use_cache", true}, {"tie_word_embeddings", false}, {"rope_theta", 10000.0},
      {"rope_scaling", nullptr}, {"attention_bias", false}, {"attention_dropout", 0.0},
      {"bos_token_id", nullptr}, {"eos_token_id", 3}, {"pad_token_id", nullptr},
      {"torch_dtype", "bfloat16"}, {"num_experts", 4}, {"num_experts_per_tok", 2},
      {"norm_topk_prob", true}, {"output_router_logits", false},
      {"router_aux_loss_coef", 0.01}, {"decoder_sparse_step", 1},
      {"mlp_only_layers", json::array()}, {"use_sliding_window", false},
      {"sliding_window", nullptr}, {"max_window_layers", 2}};
  EXPECT_EQ(hf_config_from_model(m, "bfloat16"), expected)
      << hf_config_from_model(m, "bfloat16").dump(2);
}

TEST(InteropHfConfig, DenseModelsExportAsQwen3AndLlama) {
  const json q = hf_config_from_model(interop_test::tiny("dense", "per_head"), "float32");
  EXPECT_EQ(q["architectures"], json({"Qwen3ForCausalLM"}));
  EXPECT_EQ(q["model_type"], "qwen3");
  EXPECT_EQ(q["head_dim"], 4);
  EXPECT_FALSE(q.contains("num_experts"));
  const json l = hf_config_from_model(interop_test::tiny("dense", "none"), "float32");
  EXPECT_EQ(l["architectures"], json({"LlamaForCausalLM"}));
  EXPECT_EQ(l["model_type"], "llama");
  EXPECT_EQ(l["mlp_bias"], false);
}

TEST(InteropHfConfig, RefusesCombinationsNoClassComputes) {
  try {
    hf_architecture_for(interop_test::tiny("moe", "none"));
    FAIL() << "moe without QK-norm was accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("model.qk_norm is 'none'"));
    EXPECT_THAT(e.what(), HasSubstr("model.block_type 'moe'"));
  }
  try {
    hf_architecture_for(interop_test::tiny("dense", "whole"));
    FAIL() << "dense with whole QK-norm was accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("model.qk_norm is 'whole' with model.block_type 'dense'"));
  }
}

// The config.json of Qwen/Qwen3-1.7B as published (the paper's upcycling source).
json qwen3_1_7b() {
  return json::parse(R"({
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
    "sliding_window": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
    "vocab_size": 151936})");
}

TEST(InteropHfConfig, ReadsQwen3_1_7B) {
  const HfImportedConfig c = hf_config_to_model(qwen3_1_7b(), "config.json");
  EXPECT_EQ(c.model_type, "qwen3");
  EXPECT_EQ(c.model.block_type, "dense");
  EXPECT_EQ(c.model.qk_norm, "per_head");
  EXPECT_EQ(c.model.d_model, 2048);
  EXPECT_EQ(c.model.n_layers, 28);
  EXPECT_EQ(c.model.n_heads, 16);
  EXPECT_EQ(c.model.kv_heads(), 8);
  EXPECT_EQ(c.model.head_dim(), 128);
  EXPECT_EQ(c.model.ffn_hidden_size(), 6144);  // F (model.mlp_hidden_size is 2F, as in OLMo)
  EXPECT_EQ(c.model.vocab_size, 151936);
  EXPECT_EQ(c.model.rope_theta, 1e6);
  EXPECT_EQ(c.model.layer_norm_eps, 1e-6);
  EXPECT_EQ(c.model.max_sequence_length, 40960);
  EXPECT_EQ(c.model.eos_token_id, 151645);
  EXPECT_EQ(c.model.pad_token_id, -1);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_TRUE(c.has_eos);
  EXPECT_EQ(hf_config_to_model(qwen3_1_7b(), "config.json", 2048).model.max_sequence_length,
            2048);
}

TEST(InteropHfConfig, ReadsOlmoe1B7B) {
  // allenai/OLMoE-1B-7B-0924 config.json as published.
  const json j = json::parse(R"({
    "architectures": ["OlmoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "clip_qkv": null, "eos_token_id": 50279, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 1024, "max_position_embeddings": 4096,
    "model_type": "olmoe", "norm_topk_prob": false, "num_attention_heads": 16,
    "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 16,
    "num_key_value_heads": 16, "output_router_logits": false, "pad_token_id": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 10000.0,
    "router_aux_loss_coef": 0.01, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 50304})");
  const HfImportedConfig c = hf_config_to_model(j, "config.json");
  EXPECT_EQ(c.model.block_type, "moe");
  EXPECT_EQ(c.model.qk_norm, "whole");
  EXPECT_EQ(c.model.moe_num_experts, 64);
  EXPECT_EQ(c.model.moe_top_k, 8);
  EXPECT_FALSE(c.model.moe_norm_topk_prob);
  EXPECT_EQ(c.model.ffn_hidden_size(), 1024);
  EXPECT_EQ(c.model.n_kv_heads, 0);
  EXPECT_EQ(c.model.layer_norm_eps, 1e-5);
  EXPECT_EQ(c.model.pad_token_id, 1);
  EXPECT_EQ(c.model.eos_token_id, 50279);
  EXPECT_FALSE(c.tie_word_embeddings);
}

TEST(InteropHfConfig, RefusesWhatSpesCannotRepresentNamingTheKey) {
  struct Case {
    std::function<void(json&)> edit;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {[](json& j) { j["model_type"] = "qwen2"; }, "'model_type' is \"qwen2\""},
      {[](json& j) { j["model_type"] = "olmo2"; }, "post_attention_layernorm"},
      {[](json& j) { j["model_type"] = "gpt2"; }, "'model_type' is \"gpt2\""},
      {[](json& j) { j["attention_bias"] = true; }, "'attention_bias' is true"},
      {[](json& j) { j["use_sliding_window"] = true; }, "'use_sliding_window' is true"},
      {[](json& j) { j["hidden_act"] = "gelu"; }, "'hidden_act' is \"gelu\""},
      {[](json& j) { j["head_dim"] = 64; }, "'head_dim' is 64"},
      {[](json& j) { j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}}; },
       "'rope_scaling.rope_type' is 'yarn'"},
      {[](json& j) { j["rope_parameters"] = {{"rope_type", "llama3"}}; },
       "'rope_parameters.rope_type' is 'llama3'"},
      {[](json& j) { j["layer_types"] = {"full_attention", "sliding_attention"}; },
       "'layer_types'"},
      {[](json& j) { j.erase("hidden_size"); }, "required key 'hidden_size' is missing"},
      {[](json& j) { j["num_hidden_layers"] = "28"; }, "'num_hidden_layers' must be an integer"},
  };
  for (const auto& c : cases) {
    json j = qwen3_1_7b();
    c.edit(j);
    const std::string err = error_of(j);
    EXPECT_THAT(err, HasSubstr(c.expect)) << j.dump();
    EXPECT_THAT(err, HasSubstr("cfg/config.json"));
  }
  json moe = hf_config_from_model(interop_test::tiny("moe", "per_head", true), "float32");
  moe["mlp_only_layers"] = {0};
  EXPECT_THAT(error_of(moe), HasSubstr("'mlp_only_layers' is [0]"));
  moe["mlp_only_layers"] = json::array();
  moe["decoder_sparse_step"] = 2;
  EXPECT_THAT(error_of(moe), HasSubstr("'decoder_sparse_step' is 2"));
  json olmoe = hf_config_from_model(interop_test::tiny("moe", "whole"), "float32");
  olmoe["clip_qkv"] = 8.0;
  EXPECT_THAT(error_of(olmoe), HasSubstr("'clip_qkv' is 8.0"));
}

TEST(InteropHfConfig, ExportThenImportGivesTheSameArchitecture) {
  for (const ModelConfig& m :
       {interop_test::tiny("moe", "whole", false, 2), interop_test::tiny("moe", "whole", true),
        interop_test::tiny("moe", "per_head", true, 1), interop_test::tiny("dense", "per_head"),
        interop_test::tiny("dense", "none", false, 2)}) {
    const HfImportedConfig c = hf_config_to_model(hf_config_from_model(m, "float32"), "x");
    EXPECT_EQ(c.model.block_type, m.block_type);
    EXPECT_EQ(c.model.qk_norm, m.qk_norm);
    EXPECT_EQ(c.model.d_model, m.d_model);
    EXPECT_EQ(c.model.n_layers, m.n_layers);
    EXPECT_EQ(c.model.n_heads, m.n_heads);
    EXPECT_EQ(c.model.kv_heads(), m.kv_heads());
    EXPECT_EQ(c.model.mlp_hidden_size, m.mlp_hidden_size);
    EXPECT_EQ(c.model.vocab_size, m.vocab_size);
    EXPECT_EQ(c.model.max_sequence_length, m.max_sequence_length);
    EXPECT_EQ(c.model.rope_theta, m.rope_theta);
    EXPECT_EQ(c.model.layer_norm_eps, m.layer_norm_eps);
    EXPECT_EQ(c.model.eos_token_id, m.eos_token_id);
    EXPECT_EQ(c.model.pad_token_id, m.pad_token_id);
    if (m.is_moe()) {
      EXPECT_EQ(c.model.moe_num_experts, m.moe_num_experts);
      EXPECT_EQ(c.model.moe_top_k, m.moe_top_k);
      EXPECT_EQ(c.model.moe_norm_topk_prob, m.moe_norm_topk_prob);
    }
  }
}

}  // namespace
