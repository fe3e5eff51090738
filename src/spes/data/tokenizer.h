// Tokenizer interface with two implementations: a Hugging Face tokenizer.json byte-level BPE
// (GPT-2, GPT-NeoX, Qwen; hf_bpe_tokenizer.cpp) and SentencePiece models
// (sentencepiece_tokenizer.cpp). tokenizer_load picks one by file content.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace spes {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<int64_t> encode(const std::string& text) const = 0;
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t eos_id() const = 0;   // end-of-document token appended after each document
  virtual std::string kind() const = 0; // "hf-bpe" | "sentencepiece"
};

// Loads tokenizer.json (Hugging Face) or a SentencePiece .model file.
std::unique_ptr<Tokenizer> tokenizer_load(const std::string& path);

// Trains a SentencePiece model (BPE or unigram) on text files; writes `model_prefix`.model.
void sentencepiece_train(const std::vector<std::string>& text_files, int64_t vocab_size,
                         const std::string& model_prefix, const std::string& model_type = "bpe");

}  // namespace spes
