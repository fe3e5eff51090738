// Hugging Face directory -> spes config and tensors (see hf_import.h).
#include "spes/interop/hf_import.h"

#include <filesystem>
#include <spdlog/spdlog.h>

#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/data/tokenizer.h"
#include "spes/interop/hf_tokenizer.h"
#include "spes/interop/hf_weights.h"
#include "spes/interop/model_build.h"
#include "spes/io/files.h"
#include "spes/io/json_depth.h"

namespace spes {
namespace fs = std::filesystem;

NamedTensors hf_tensors_to_spes(NamedTensors raw, bool tied_embeddings,
                                const std::string& origin) {
  NamedTensors out;
  const torch::Tensor* embed = nullptr;
  bool has_head = false;
  for (auto& [name, t] : raw) {
    if (ends_with(name, ".rotary_emb.inv_freq")) continue;  // derived from rope_theta
    SPES_CHECK(!ends_with(name, ".bias"), "{}: tensor '{}' is a bias; spes models have no biases",
               origin, name);
    SPES_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16 ||
                   t.scalar_type() == torch::kFloat16,
               "{}: tensor '{}' has dtype {}; expected float32, bfloat16 or float16", origin,
               name, c10::toString(t.scalar_type()));
    if (name == "lm_head.weight") {
      has_head = true;
      if (tied_embeddings) continue;  // transformers uses embed_tokens for a tied head
    }
    out.emplace_back(name, t.to(torch::kFloat32));
  }
  for (const auto& [name, t] : out)
    if (name == "model.embed_tokens.weight") embed = &t;
  if (tied_embeddings) {
    SPES_CHECK(embed, "{}: model.embed_tokens.weight is missing", origin);
    torch::Tensor head = embed->clone();
    out.emplace_back("lm_head.weight", std::move(head));
  } else {
    SPES_CHECK(has_head, "{}: lm_head.weight is missing and config.json says "
               "tie_word_embeddings false", origin);
  }
  return out;
}

HfModel hf_import(const std::string& dir, int64_t max_seq_len) {
  const std::string cfg_path = dir + "/config.json";
  SPES_CHECK(fs::exists(cfg_path), "'{}' is not a Hugging Face model directory (no config.json)",
             dir);
  const nlohmann::json j = json_parse_bounded(file_read(cfg_path), cfg_path);
  const HfImportedConfig ic = hf_config_to_model(j, cfg_path, max_seq_len);
  HfModel m;
  m.config.model = ic.model;
  m.model_type = ic.model_type;
  m.tied_embeddings = ic.tie_word_embeddings;
  m.tokenizer_file = find_tokenizer_file(dir);
  if (!ic.has_eos && !m.tokenizer_file.empty()) {
    try {
      m.config.model.eos_token_id = tokenizer_load(m.tokenizer_file)->eos_id();
    } catch (const Error& e) {
      spdlog::warn("{}: config.json has no eos_token_id and the tokenizer cannot be read ({}); "
                   "model.eos_token_id stays {}", dir, e.what(), m.config.model.eos_token_id);
    }
  }
  config_validate(m.config, cfg_path);
  m.tensors = hf_tensors_to_spes(hf_read_weights(dir), ic.tie_word_embeddings, dir);
  if (ic.tie_word_embeddings)
    spdlog::info("{}: tie_word_embeddings is true; lm_head starts as a copy of embed_tokens and "
                 "is trained separately (spes heads are untied)", dir);
  return m;
}

HfImportResult hf_import_to_checkpoint(const std::string& hf_dir, const std::string& out_dir,
                                       int64_t max_seq_len, bool weights_only, bool overwrite) {
  check_output_dir(out_dir, overwrite);
  HfModel h = hf_import(hf_dir, max_seq_len);
  HfImportResult r;
  r.model_type = h.model_type;
  r.model = h.config.model;
  r.tied_embeddings = h.tied_embeddings;
  r.has_tokenizer = !h.tokenizer_file.empty();
  auto model = model_from_tensors(h.config, h.tensors, hf_dir);
  h.tensors.clear();  // the model holds its own copy
  r.num_params = model->num_params();
  checkpoint_write_fresh(out_dir, h.config, *model, h.tokenizer_file, weights_only);
  return r;
}

}  // namespace spes
