// Starting weights given as data (model.init_checkpoint): the architecture they were made for
// and their tensors by name, in model order. Transformer::init_weights copies them in after
// checking that the architecture equals the run's model section (every field that changes the
// function the model computes; the run's other settings are its own). Leaves out: reading a
// directory (a spes checkpoint or a Hugging Face directory) into InitialWeights, which is done
// above the model by the reader that interop/init_checkpoint.h installs here.
#pragma once
#include <functional>
#include <string>

#include "spes/io/config.h"
#include "spes/io/safetensors.h"

namespace spes {

struct InitialWeights {
  ModelConfig architecture;  // of the model the tensors come from
  NamedTensors tensors;      // every parameter, in model order
  std::string origin;        // names the source in errors
};

// Reads the directory that model.init_checkpoint names.
using InitialWeightsReader = std::function<InitialWeights(const std::string& dir)>;
void install_initial_weights_reader(InitialWeightsReader reader);
// The installed reader's result for `dir`; throws when no reader is installed.
InitialWeights read_initial_weights(const std::string& dir);

// Throws naming the first field where `run` and `source` differ in architecture.
void check_same_architecture(const ModelConfig& run, const ModelConfig& source,
                             const std::string& origin);

}  // namespace spes
