// Hugging Face config.json <-> ModelConfig. Export picks the transformers class that computes
// exactly our model (OlmoeForCausalLM, Qwen3MoeForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM);
// import accepts those plus the dense families we can represent and refuses, naming the key and
// value, every structural feature our model lacks (biases, post-norm blocks, sliding windows,
// RoPE scaling, ...). The full key mapping is in docs/INTEROP.md.
// Leaves out: reading weights (hf_weights.h) and tokenizer files (hf_tokenizer.h).
#pragma once
#include <nlohmann/json.hpp>

#include <string>

#include "spes/io/config.h"

namespace spes {

// The transformers class for a model: {"architecture", "model_type"}.
struct HfArchitecture {
  std::string architecture;  // e.g. OlmoeForCausalLM
  std::string model_type;    // e.g. olmoe
};

// Which class exports `m`; throws naming model.block_type / model.qk_norm when none fits.
HfArchitecture hf_architecture_for(const ModelConfig& m);

// config.json for `m`. torch_dtype: "float32" | "bfloat16" | "float16".
nlohmann::json hf_config_from_model(const ModelConfig& m, const std::string& torch_dtype);

struct HfImportedConfig {
  ModelConfig model;
  std::string model_type;
  bool tie_word_embeddings = false;  // lm_head is a copy of embed_tokens (untied on import)
  bool has_eos = false;              // eos_token_id was given (else: take the tokenizer's)
};

// Parses config.json. `origin` (the file path) names it in errors. max_seq_len > 0 overrides
// max_position_embeddings as model.max_sequence_length.
HfImportedConfig hf_config_to_model(const nlohmann::json& j, const std::string& origin,
                                    int64_t max_seq_len = 0);

}  // namespace spes
