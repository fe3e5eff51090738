// A trained model ready for evaluation or sampling: the config, weights and tokenizer read from
// a checkpoint directory (the tokenizer is the copy saved in the checkpoint, or the one the
// config's data names).
#pragma once
#include <memory>
#include <string>

#include "spes/data/tokenizer.h"
#include "spes/io/config.h"
#include "spes/model/transformer.h"

namespace spes {

struct LoadedModel {
  Config config;
  std::unique_ptr<Transformer> model;
  std::unique_ptr<Tokenizer> tokenizer;  // null when none can be found
};

LoadedModel load_model_from_checkpoint(const std::string& dir);

}  // namespace spes
