// spes checkpoint -> Hugging Face directory (see hf_export.h).
#include "spes/interop/hf_export.h"

#include <unistd.h>

#include <filesystem>

#include "spes/common/error.h"
#include "spes/interop/hf_tokenizer.h"
#include "spes/interop/hf_weights.h"
#include "spes/interop/model_build.h"
#include "spes/interop/model_source.h"
#include "spes/io/files.h"
#include "spes/train/checkpoint.h"

namespace spes {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

void write_export(const std::string& tmp, const SourceModel& src, const HfExportOptions& o,
                  HfExportResult* out) {
  HfExportResult& r = *out;
  const ModelConfig& m = src.config.model;
  NamedTensors tensors;
  for (const auto& p : src.model->params()) {
    tensors.emplace_back(p.name, p.tensor.detach());
    r.weight_bytes += p.tensor.numel() * static_cast<int64_t>(c10::elementSize(o.dtype));
  }
  r.files = hf_write_weights(tmp, tensors, o.dtype, o.max_shard_bytes);
  file_write_atomic(tmp + "/config.json",
                    hf_config_from_model(m, hf_dtype_name(o.dtype)).dump(2) + "\n");
  r.files.push_back("config.json");
  if (m.eos_token_id >= 0) {
    json g = {{"_from_model_config", true}, {"eos_token_id", m.eos_token_id}};
    if (m.pad_token_id >= 0) g["pad_token_id"] = m.pad_token_id;
    file_write_atomic(tmp + "/generation_config.json", g.dump(2) + "\n");
    r.files.push_back("generation_config.json");
  }
  r.notes = hf_write_tokenizer(tmp, src.tokenizer_file, m);
  for (const char* f : {"tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                        "special_tokens_map.json"})
    if (fs::exists(tmp + "/" + f)) r.files.push_back(f);
}

}  // namespace

HfExportResult hf_export(const std::string& checkpoint_dir, const std::string& out_dir,
                         const HfExportOptions& o) {
  check_output_dir(out_dir, o.overwrite);
  SPES_CHECK(model_dir_kind(checkpoint_dir) == ModelDirKind::Checkpoint,
             "'{}' is a Hugging Face directory already; export-hf reads spes checkpoints",
             checkpoint_dir);
  HfExportResult r;
  // The class first: an unexportable architecture fails before any weight is read.
  r.architecture = hf_architecture_for(checkpoint_config(checkpoint_dir).model);
  const SourceModel src = source_model_load(checkpoint_dir);

  const fs::path dst(out_dir);
  if (dst.has_parent_path()) fs::create_directories(dst.parent_path());
  const std::string tmp = out_dir + ".tmp." + std::to_string(::getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  try {
    write_export(tmp, src, o, &r);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);  // never leave a half-written export behind
    throw;
  }
  dir_fsync(tmp);
  dir_commit(tmp, out_dir);
  return r;
}

}  // namespace spes
