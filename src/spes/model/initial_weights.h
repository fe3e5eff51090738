// Starting weights given as data (model.init_checkpoint): the architecture they were made for
// and their tensors by name, in model order. Transformer::init_weights copies them in after
// checking that the architecture equals the run's model section (every field that changes the
// function the model computes; the run's other settings are its own). Leaves out: reading a
// directory (a spes checkpoint or a Hugging Face directory) into InitialWeights, which the
// command that builds a model does above the model (interop/init_checkpoint.h) before handing
// them down.
#pragma once
#include <string>

#include "spes/io/config.h"
#include "spes/io/safetensors.h"

namespace spes {

struct InitialWeights {
  ModelConfig architecture;  // of the model the tensors come from
  NamedTensors tensors;      // every parameter, in model order
  std::string origin;        // names the source in errors
};

// Throws naming the first field where `run` and `source` differ in architecture.
void check_same_architecture(const ModelConfig& run, const ModelConfig& source,
                             const std::string& origin);

}  // namespace spes
