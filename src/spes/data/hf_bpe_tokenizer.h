// Native Hugging Face tokenizer.json loader for byte-level BPE (GPT-2, GPT-NeoX, Qwen, Llama-3):
// added tokens (split out first, leftmost-longest, with special/normalized/lstrip/rstrip/
// single_word as the `tokenizers` library treats them), NFC normalizer, ByteLevel and Split
// pre-tokenizers (alone or in a Sequence), BPE merges by rank with a word cache, ByteLevel
// decoding. encode() adds no special tokens (like addSpecialTokens=false: the post_processor is
// ignored); decode() keeps special tokens (skip_special_tokens=false).
// eos_id(): the first of <|endoftext|>, <|end_of_text|>, </s>, <eos>, <|eos|>, <|im_end|>,
// <|eot_id|> found among the added tokens, else in the vocabulary; none found is an error.
// Leaves out: other normalizers (NFKC, Lowercase, Replace, ...), other pre-tokenizers
// (Metaspace, Digits, Whitespace, ...), WordPiece/Unigram models, BPE dropout, subword prefixes.
#pragma once
#include <memory>
#include <string>

#include "spes/data/tokenizer.h"

namespace spes {

class HfBpeTokenizer : public Tokenizer {
 public:
  // Parses tokenizer.json text; `origin` (usually the file path) names it in errors.
  static std::unique_ptr<HfBpeTokenizer> from_json(const std::string& json_text,
                                                   const std::string& origin);
  ~HfBpeTokenizer() override;

  std::vector<int64_t> encode(const std::string& text) const override;
  std::string decode(const std::vector<int64_t>& ids) const override;
  int64_t vocab_size() const override;
  int64_t eos_id() const override;
  std::string kind() const override { return "hf-bpe"; }

  // The token string of `id` as stored in the file ("" for an unused id); -1 for absent tokens.
  std::string id_to_token(int64_t id) const;
  int64_t token_to_id(const std::string& token) const;

 private:
  HfBpeTokenizer();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spes
