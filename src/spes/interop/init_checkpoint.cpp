// model.init_checkpoint (see init_checkpoint.h).
#include "spes/interop/init_checkpoint.h"

#include "spes/interop/model_source.h"

namespace spes {

InitialWeights init_checkpoint_read(const std::string& dir) {
  SourceModel src = source_model_load(dir);
  InitialWeights w;
  w.architecture = src.config.model;
  w.origin = "model.init_checkpoint " + dir;
  for (const auto& p : src.model->params()) w.tensors.emplace_back(p.name, p.tensor);
  return w;
}

std::optional<InitialWeights> init_checkpoint_weights(const ModelConfig& model) {
  if (model.init_checkpoint.empty()) return std::nullopt;
  return init_checkpoint_read(model.init_checkpoint);
}

}  // namespace spes
