// model.init_checkpoint: a fresh run (spes train, the sync server's initial model, every node)
// starts from the weights of a checkpoint or Hugging Face directory instead of a random init.
// This file reads such a directory into InitialWeights (model/initial_weights.h), which
// Transformer::init_weights checks and copies in; including this header installs the reader, so
// every program that includes it (the `spes` binary does, in cli/main.cpp) honours the key
// wherever a model is initialised. Leaves out: the architecture check and the copy (the model's).
#pragma once
#include <string>

#include "spes/model/initial_weights.h"

namespace spes {

// The weights of `dir` (a checkpoint or a Hugging Face directory) with their architecture.
InitialWeights init_checkpoint_read(const std::string& dir);

// Installs init_checkpoint_read as the reader of model.init_checkpoint; returns true.
bool install_init_checkpoint_reader();
inline const bool kInitCheckpointReaderInstalled = install_init_checkpoint_reader();

}  // namespace spes
