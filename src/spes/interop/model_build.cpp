// Models from named tensors and fresh checkpoints (see model_build.h).
#include "spes/interop/model_build.h"

#include <filesystem>

#include "spes/common/error.h"
#include "spes/model/ownership.h"
#include "spes/model/registry.h"
#include "spes/train/checkpoint.h"
#include "spes/train/optimizer.h"

namespace spes {

void check_output_dir(const std::string& dir, bool overwrite) {
  SPES_CHECK(overwrite || !std::filesystem::exists(dir),
             "'{}' already exists; choose another output directory or pass --overwrite", dir);
}

Config config_single_node(const Config& cfg) {
  Config c = cfg;
  c.spes_config = SpesConfig{};
  c.frozen_experts.clear();
  return c;
}

std::unique_ptr<Transformer> model_from_tensors(const Config& cfg, const NamedTensors& tensors,
                                                const std::string& origin) {
  const Config c = config_single_node(cfg);
  auto model = std::make_unique<Transformer>(c.model, torch::kCPU);
  ParamRegistry reg(*model, c, Ownership::from_config(c), 0);
  registry_load_tensors(reg, tensors, /*require_all=*/true, origin);
  for (const auto& p : model->params()) p.tensor.set_requires_grad(false);
  return model;
}

void checkpoint_write_fresh(const std::string& dir, const Config& cfg, const Transformer& model,
                            const std::string& tokenizer_file, bool weights_only) {
  Config c = config_single_node(cfg);
  c.model.init_checkpoint.clear();
  config_validate(c, dir + "/config.yaml");
  std::vector<bool> grad;
  for (const auto& p : model.params()) grad.push_back(p.tensor.requires_grad());
  {
    ParamRegistry reg(model, c, Ownership::from_config(c), 0);  // sets requires_grad
    std::unique_ptr<AdamW> opt;
    if (!weights_only) opt = std::make_unique<AdamW>(reg.trainable(), c.optimizer);
    checkpoint_save(dir, c, reg, opt.get(), TrainState{}, tokenizer_file);
  }
  for (size_t i = 0; i < grad.size(); ++i) model.params()[i].tensor.set_requires_grad(grad[i]);
}

}  // namespace spes
