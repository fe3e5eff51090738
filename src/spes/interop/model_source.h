// One way to load "a model" from a directory, whatever produced it: a spes checkpoint
// (state.json) or a Hugging Face directory (config.json). Used by score, upcycle and
// model.init_checkpoint.
#pragma once
#include <memory>
#include <string>

#include "spes/io/config.h"
#include "spes/model/transformer.h"

namespace spes {

enum class ModelDirKind { Checkpoint, HuggingFace };

// Which kind `dir` is; throws naming what was looked for when it is neither.
ModelDirKind model_dir_kind(const std::string& dir);

struct SourceModel {
  Config config;                       // single-node config of the model
  std::unique_ptr<Transformer> model;  // CPU, fp32, no grad
  std::string tokenizer_file;          // "" when none is known
  ModelDirKind kind = ModelDirKind::Checkpoint;
};

// max_seq_len > 0 overrides the HF max_position_embeddings (ignored for checkpoints).
SourceModel source_model_load(const std::string& dir, int64_t max_seq_len = 0);

}  // namespace spes
