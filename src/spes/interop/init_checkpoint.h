// model.init_checkpoint: a fresh run (spes train, the sync server's initial model, every node)
// starts from the weights of a checkpoint or Hugging Face directory instead of a random init.
// Called from Transformer::init_weights, so every place that initialises a model honours it.
// The architecture of the directory must equal the run's model section (every field that
// changes the function the model computes); the run's other settings are its own.
#pragma once
#include <string>

#include "spes/io/config.h"
#include "spes/model/transformer.h"

namespace spes {

// Throws naming the first field where `run` and `source` differ in architecture.
void check_same_architecture(const ModelConfig& run, const ModelConfig& source,
                             const std::string& origin);

// Copies the weights of `dir` into `model` (same names and shapes, checked).
void model_load_init_checkpoint(const Transformer& model, const std::string& dir);

}  // namespace spes
