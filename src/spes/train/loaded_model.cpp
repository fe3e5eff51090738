// Loading a checkpoint for evaluation (see loaded_model.h).
#include "spes/train/loaded_model.h"

#include <filesystem>

#include "spes/common/error.h"
#include "spes/data/tokenizer_path.h"
#include "spes/io/files.h"
#include "spes/model/registry.h"
#include "spes/train/checkpoint.h"

namespace spes {
namespace fs = std::filesystem;

LoadedModel load_model_from_checkpoint(const std::string& dir) {
  LoadedModel m;
  m.config = checkpoint_config(dir);
  m.config.spes_config.mode = SyncMode::Centralized;  // a loaded model is a plain model
  m.config.spes_config.num_peers = 1;
  m.config.spes_config.peer_id = 0;
  m.config.spes_config.expert_owners.clear();
  m.config.frozen_experts.clear();
  m.model = std::make_unique<Transformer>(m.config.model, torch::kCPU);
  ParamRegistry reg(*m.model, m.config, Ownership::from_config(m.config), 0);
  checkpoint_load(dir, reg, nullptr);
  for (const auto& e : reg.entries()) e.tensor.set_requires_grad(false);
  for (const char* name : {"tokenizer.json", "tokenizer.model"}) {
    if (fs::exists(dir + "/" + name)) {
      m.tokenizer = tokenizer_load(dir + "/" + name);
      return m;
    }
  }
  const std::string t = resolve_tokenizer_path(m.config.data);
  if (!t.empty()) m.tokenizer = tokenizer_load(t);
  return m;
}

}  // namespace spes
