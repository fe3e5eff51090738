// SentencePiece tokenizers: a wrapper over libsentencepiece's processor (any .model file), and
// training of small BPE/unigram vocabularies for `spes prepare`. Trained models use byte
// fallback, full character coverage, identity normalization and no whitespace squeezing, so
// decode(encode(text)) == text for any UTF-8 text; ids: unk 0, bos 1, eos 2, no pad.
// Leaves out: sampling (subword regularization), user-defined symbols.
#pragma once
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "spes/data/sentencepiece_lib.h"
#include "spes/data/tokenizer.h"


namespace spes {

class SentencePieceTokenizer : public Tokenizer {
 public:
  // Loads a serialized model (the bytes of a .model file); `origin` names it in errors.
  static std::unique_ptr<SentencePieceTokenizer> from_bytes(const std::string& model_bytes,
                                                            const std::string& origin);
  ~SentencePieceTokenizer() override;

  std::vector<int64_t> encode(const std::string& text) const override;
  std::string decode(const std::vector<int64_t>& ids) const override;
  int64_t vocab_size() const override;
  int64_t eos_id() const override;
  std::string kind() const override { return "sentencepiece"; }

 private:
  SentencePieceTokenizer();
  std::unique_ptr<SentencePieceModel> sp_;
  std::string origin_;
};

// A deterministic uniform sample (reservoir, fixed seed) of at most `capacity` sentences: the
// training input of a SentencePiece model, whatever the corpus size.
class SentenceSampler {
 public:
  explicit SentenceSampler(size_t capacity = 200000, uint64_t seed = 1234);
  void add(const std::string& sentence);  // empty sentences are ignored
  // Splits text into lines and adds each one.
  void add_lines(const std::string& text);
  size_t seen() const { return seen_; }
  std::vector<std::string> take() { return std::move(kept_); }

 private:
  size_t capacity_;
  size_t seen_ = 0;
  std::mt19937_64 rng_;
  std::vector<std::string> kept_;
};

// Trains on `sentences` (one training sentence each) and writes `model_prefix`.model and .vocab.
// model_type: "bpe" | "unigram". Throws spes::Error when training fails (e.g. vocab too large
// for the text).
void sentencepiece_train_sentences(const std::vector<std::string>& sentences, int64_t vocab_size,
                                   const std::string& model_prefix, const std::string& model_type);

}  // namespace spes
