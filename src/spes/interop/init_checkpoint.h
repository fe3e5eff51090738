// model.init_checkpoint: a fresh run (spes train, the sync server's initial model, every node)
// starts from the weights of a checkpoint or Hugging Face directory instead of a random init.
// The commands that build a model (cli/, cluster/) read them here and hand them down to what
// builds it (Trainer, SyncServer, SyncModel), which copies them in with
// Transformer::init_weights. Leaves out: the architecture check and the copy (the model's).
#pragma once
#include <optional>
#include <string>

#include "spes/io/config.h"
#include "spes/model/initial_weights.h"

namespace spes {

// The weights of `dir` (a checkpoint or a Hugging Face directory) with their architecture.
InitialWeights init_checkpoint_read(const std::string& dir);

// The weights `model.init_checkpoint` names; none when it is empty (a random init).
std::optional<InitialWeights> init_checkpoint_weights(const ModelConfig& model);

}  // namespace spes
