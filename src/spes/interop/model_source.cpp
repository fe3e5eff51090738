// Loading a model from a checkpoint or a Hugging Face directory (see model_source.h).
#include "spes/interop/model_source.h"

#include <filesystem>

#include "spes/common/error.h"
#include "spes/data/tokenizer_path.h"
#include "spes/interop/hf_import.h"
#include "spes/interop/hf_tokenizer.h"
#include "spes/interop/model_build.h"
#include "spes/io/run_layout.h"
#include "spes/train/loaded_model.h"

namespace spes {
namespace fs = std::filesystem;

ModelDirKind model_dir_kind(const std::string& dir) {
  SPES_CHECK(fs::is_directory(dir), "'{}' is not a directory", dir);
  if (fs::exists(run_layout::checkpoint_state(dir))) return ModelDirKind::Checkpoint;
  if (fs::exists(dir + "/config.json")) return ModelDirKind::HuggingFace;
  fail("'{}' is neither a spes checkpoint (state.json) nor a Hugging Face model directory "
       "(config.json)", dir);
}

SourceModel source_model_load(const std::string& dir, int64_t max_seq_len) {
  SourceModel s;
  s.kind = model_dir_kind(dir);
  if (s.kind == ModelDirKind::Checkpoint) {
    LoadedModel m = load_model_from_checkpoint(dir);
    s.config = config_single_node(m.config);
    s.model = std::move(m.model);
    s.tokenizer_file = find_tokenizer_file(dir);
    if (s.tokenizer_file.empty()) s.tokenizer_file = resolve_tokenizer_path(m.config.data);
    return s;
  }
  HfModel h = hf_import(dir, max_seq_len);
  s.config = h.config;
  s.model = model_from_tensors(h.config, h.tensors, dir);
  s.tokenizer_file = h.tokenizer_file;
  return s;
}

}  // namespace spes
