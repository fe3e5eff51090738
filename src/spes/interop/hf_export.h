// spes checkpoint -> Hugging Face directory that transformers loads without custom code:
// config.json (hf_config), model.safetensors or shards + index (hf_weights), tokenizer files
// (hf_tokenizer) and generation_config.json, written into a temporary directory and renamed.
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

#include "spes/interop/hf_config.h"

namespace spes {

struct HfExportOptions {
  torch::ScalarType dtype = torch::kFloat32;
  int64_t max_shard_bytes = 5000000000;  // transformers' default "5GB"
  bool overwrite = false;                // replace an existing OUT
};

struct HfExportResult {
  HfArchitecture architecture;
  std::vector<std::string> files;  // written into OUT
  int64_t weight_bytes = 0;        // tensor data bytes
  std::vector<std::string> notes;  // what could not be written (e.g. SentencePiece tokenizer)
};

HfExportResult hf_export(const std::string& checkpoint_dir, const std::string& out_dir,
                         const HfExportOptions& o);

}  // namespace spes
