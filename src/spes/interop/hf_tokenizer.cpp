// Tokenizer files of a Hugging Face model directory (see hf_tokenizer.h).
#include "spes/interop/hf_tokenizer.h"

#include <nlohmann/json.hpp>

#include <filesystem>

#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/data/hf_bpe_tokenizer.h"
#include "spes/data/sentencepiece_lib.h"
#include "spes/io/files.h"

namespace spes {
namespace fs = std::filesystem;
using json = nlohmann::json;

std::string find_tokenizer_file(const std::string& dir) {
  for (const char* name : {"tokenizer.json", "tokenizer.model"})
    if (fs::exists(dir + "/" + name)) return dir + "/" + name;
  return "";
}

std::vector<std::string> hf_write_tokenizer(const std::string& dir,
                                            const std::string& tokenizer_file,
                                            const ModelConfig& m) {
  std::vector<std::string> notes;
  if (tokenizer_file.empty()) {
    notes.push_back("no tokenizer found (none kept in the checkpoint, none named by its "
                    "data.tokenizer): the export has weights and config only");
    return notes;
  }
  const std::string bytes = file_read(tokenizer_file);
  json tc = {{"model_max_length", m.max_sequence_length},
             {"add_bos_token", false},
             {"add_eos_token", false},
             {"clean_up_tokenization_spaces", false},
             {"bos_token", nullptr}};
  json special = json::object();
  auto set_token = [&](const char* key, int64_t id, const std::string& tok) {
    if (id < 0) return;
    if (tok.empty()) {
      notes.push_back(fmt::format("token id {} ({}) has no token string in {}; {} is not set in "
                                  "tokenizer_config.json", id, key, tokenizer_file, key));
      return;
    }
    tc[key] = tok;
    special[key] = tok;
  };
  if (ends_with(tokenizer_file, ".json")) {
    auto tok = HfBpeTokenizer::from_json(bytes, tokenizer_file);
    file_write_atomic(dir + "/tokenizer.json", bytes);
    tc["tokenizer_class"] = "PreTrainedTokenizerFast";
    set_token("eos_token", m.eos_token_id, tok->id_to_token(m.eos_token_id));
    set_token("pad_token", m.pad_token_id, tok->id_to_token(m.pad_token_id));
  } else {
    // SentencePiece: transformers' LlamaTokenizer (legacy mode) encodes with the model as is.
    SentencePieceModel sp(bytes, tokenizer_file);
    file_write_atomic(dir + "/tokenizer.model", bytes);
    tc["tokenizer_class"] = "LlamaTokenizer";
    tc["legacy"] = true;
    for (const auto& [key, piece] : std::vector<std::pair<const char*, std::string>>{
             {"eos_token", "</s>"}, {"unk_token", "<unk>"}}) {
      const int64_t id = sp.piece_to_id(piece);
      const int64_t want = std::string(key) == "eos_token" ? m.eos_token_id : 0;
      set_token(key, want, id == want ? piece : "");
    }
    // transformers reads tokenizer.model through its SentencePieceExtractor, which requires
    // both packages (convert_slow_tokenizer.py, transformers 5.24).
    notes.push_back("the tokenizer is SentencePiece: wrote tokenizer.model with a "
                    "tokenizer_config.json for LlamaTokenizer; no tokenizer.json was written, so "
                    "loading it in Python (AutoTokenizer.from_pretrained) needs the packages "
                    "sentencepiece and protobuf besides transformers: "
                    "pip install transformers sentencepiece protobuf");
  }
  file_write_atomic(dir + "/tokenizer_config.json", tc.dump(2) + "\n");
  file_write_atomic(dir + "/special_tokens_map.json", special.dump(2) + "\n");
  return notes;
}

}  // namespace spes
