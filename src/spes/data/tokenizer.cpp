// tokenizer_load: picks the implementation by file content, not by name: a JSON object with a
// "model" field is a Hugging Face tokenizer.json, anything else must parse as a SentencePiece
// model. Leaves out: tokenizer directories (pass the file itself).
#include <filesystem>

#include "spes/common/error.h"
#include "spes/data/hf_bpe_tokenizer.h"
#include "spes/data/sentencepiece_tokenizer.h"
#include "spes/data/tokenizer.h"
#include "spes/io/files.h"

namespace spes {

std::unique_ptr<Tokenizer> tokenizer_load(const std::string& path) {
  namespace fs = std::filesystem;
  SPES_CHECK(!path.empty(), "no tokenizer file given");
  SPES_CHECK(fs::exists(path), "tokenizer file '{}' does not exist", path);
  SPES_CHECK(!fs::is_directory(path),
             "tokenizer '{}' is a directory; pass the file (tokenizer.json or *.model)", path);
  const std::string bytes = file_read(path);
  SPES_CHECK(!bytes.empty(), "tokenizer file '{}' is empty", path);
  size_t i = bytes.find_first_not_of(" \t\r\n");
  if (i != std::string::npos && bytes[i] == '{') {
    // JSON: must be a tokenizer.json (a SentencePiece model is binary protobuf, never '{').
    SPES_CHECK(bytes.find("\"model\"") != std::string::npos,
               "'{}' is JSON but has no \"model\" field: not a Hugging Face tokenizer.json", path);
    return HfBpeTokenizer::from_json(bytes, path);
  }
  return SentencePieceTokenizer::from_bytes(bytes, path);
}

}  // namespace spes
