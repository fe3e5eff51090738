// SentencePiece wrapper and trainer (see sentencepiece_tokenizer.h). Training is given the
// sentences in memory, so the sample is chosen here (deterministically) rather than by the
// library's own shuffling, which this libsentencepiece version (0.1.97) cannot seed.
// libsentencepiece is reached through SentencePieceModel / sentencepiece_train_in_memory
// (sentencepiece_lib.h), which load it in isolation: it must not be linked directly.
#include "spes/data/sentencepiece_tokenizer.h"

#include <fstream>

#include "spes/common/error.h"

namespace spes {

SentencePieceTokenizer::SentencePieceTokenizer() = default;
SentencePieceTokenizer::~SentencePieceTokenizer() = default;

std::unique_ptr<SentencePieceTokenizer> SentencePieceTokenizer::from_bytes(
    const std::string& model_bytes, const std::string& origin) {
  std::unique_ptr<SentencePieceTokenizer> t(new SentencePieceTokenizer());
  t->origin_ = origin;
  t->sp_ = std::make_unique<SentencePieceModel>(model_bytes, origin);
  SPES_CHECK(t->sp_->eos_id() >= 0,
             "{}: the SentencePiece model has no eos piece (trained with eos_id=-1); SPES needs "
             "one to end each document", origin);
  return t;
}

std::vector<int64_t> SentencePieceTokenizer::encode(const std::string& text) const {
  return sp_->encode(text);
}

std::string SentencePieceTokenizer::decode(const std::vector<int64_t>& ids) const {
  for (int64_t id : ids)
    SPES_CHECK(id >= 0 && id < vocab_size(), "{}: cannot decode id {}: outside [0, {})", origin_,
               id, vocab_size());
  return sp_->decode(ids);
}

int64_t SentencePieceTokenizer::vocab_size() const { return sp_->vocab_size(); }
int64_t SentencePieceTokenizer::eos_id() const { return sp_->eos_id(); }

SentenceSampler::SentenceSampler(size_t capacity, uint64_t seed) : capacity_(capacity), rng_(seed) {}

void SentenceSampler::add(const std::string& sentence) {
  if (sentence.empty()) return;
  ++seen_;
  if (kept_.size() < capacity_) {
    kept_.push_back(sentence);
    return;
  }
  // Algorithm R; the modulo bias (< 2^-40 for any realistic count) does not matter here.
  uint64_t j = rng_() % seen_;
  if (j < capacity_) kept_[j] = sentence;
}

void SentenceSampler::add_lines(const std::string& text) {
  size_t b = 0;
  while (b <= text.size()) {
    size_t e = text.find('\n', b);
    if (e == std::string::npos) e = text.size();
    size_t end = e;
    if (end > b && text[end - 1] == '\r') --end;
    if (end > b) add(text.substr(b, end - b));
    b = e + 1;
  }
}

void sentencepiece_train_sentences(const std::vector<std::string>& sentences, int64_t vocab_size,
                                   const std::string& model_prefix,
                                   const std::string& model_type) {
  SPES_CHECK(model_type == "bpe" || model_type == "unigram",
             "tokenizer type '{}' is not supported (expected bpe or unigram)", model_type);
  SPES_CHECK(vocab_size >= 300 && vocab_size <= (1 << 20),
             "vocab size {} is out of range [300, 1048576] (byte fallback alone needs 259 ids)",
             vocab_size);
  SPES_CHECK(!sentences.empty(), "cannot train a tokenizer: no text (all inputs are empty)");
  const std::vector<std::pair<std::string, std::string>> args = {
      {"model_prefix", model_prefix},
      {"vocab_size", std::to_string(vocab_size)},
      {"model_type", model_type},
      {"character_coverage", "1.0"},
      {"byte_fallback", "true"},
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"allow_whitespace_only_pieces", "true"},
      {"split_digits", "true"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"input_sentence_size", "0"},  // already sampled by the caller
      {"shuffle_input_sentence", "false"},
      {"num_threads", "2"},
      {"minloglevel", "2"},  // warnings and errors only
  };
  try {
    sentencepiece_train_in_memory(sentences, args);
  } catch (const Error& e) {
    fail("SentencePiece training ({}, vocab {}, {} sentences): {}", model_type, vocab_size,
         sentences.size(), e.what());
  }
}

void sentencepiece_train(const std::vector<std::string>& text_files, int64_t vocab_size,
                         const std::string& model_prefix, const std::string& model_type) {
  SentenceSampler sampler;
  for (const auto& f : text_files) {
    std::ifstream in(f, std::ios::binary);
    SPES_CHECK(in.good(), "cannot read '{}' (does it exist?)", f);
    std::string line;
    while (std::getline(in, line)) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      sampler.add(line);
    }
  }
  sentencepiece_train_sentences(sampler.take(), vocab_size, model_prefix, model_type);
}

}  // namespace spes
