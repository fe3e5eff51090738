// Reading a Hugging Face model directory (config.json, safetensors weights, tokenizer) into a
// spes config and spes-named fp32 tensors. Tensor names are the same in both conventions; the
// differences handled here: tied embeddings (lm_head.weight absent: a copy of embed_tokens),
// derived buffers (rotary_emb.inv_freq: dropped, recomputed from rope_theta), biases (refused),
// dtypes (bf16/fp16/fp32 -> fp32). Every other unknown or missing tensor is an error.
#pragma once
#include <string>

#include "spes/interop/hf_config.h"
#include "spes/io/config.h"
#include "spes/io/safetensors.h"

namespace spes {

struct HfModel {
  Config config;              // built-in defaults with the model section from config.json
  std::string model_type;     // e.g. olmoe
  bool tied_embeddings = false;
  NamedTensors tensors;       // spes names, fp32
  std::string tokenizer_file; // tokenizer.json or tokenizer.model in the directory ("" if none)
};

// max_seq_len > 0 overrides max_position_embeddings as model.max_sequence_length.
HfModel hf_import(const std::string& dir, int64_t max_seq_len = 0);

struct HfImportResult {
  std::string model_type;
  ModelConfig model;
  int64_t num_params = 0;
  bool tied_embeddings = false;
  bool has_tokenizer = false;
};

// `spes import-hf`: HF directory -> checkpoint at out_dir (atomic; refuses an existing out_dir
// unless overwrite). A fresh optimizer state (zero moments, step 0) is included unless
// weights_only, so `spes train --resume out_dir` continues from these weights.
HfImportResult hf_import_to_checkpoint(const std::string& hf_dir, const std::string& out_dir,
                                       int64_t max_seq_len, bool weights_only, bool overwrite);

// The HF -> spes tensor mapping on its own (origin names the directory in errors).
NamedTensors hf_tensors_to_spes(NamedTensors raw, bool tied_embeddings,
                                const std::string& origin);

}  // namespace spes
