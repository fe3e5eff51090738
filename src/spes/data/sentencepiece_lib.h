// Access to SentencePiece through the isolated shim library (see
// src/sentencepiece_shim/sentencepiece_shim.cpp for why it is isolated). The shim is found next
// to the running executable, in the build tree, or in the install prefix's lib/.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace spes {

class SentencePieceModel {
 public:
  explicit SentencePieceModel(const std::string& path);  // throws spes::Error
  // From the bytes of a .model file; `origin` names it in errors.
  SentencePieceModel(const std::string& bytes, const std::string& origin);
  ~SentencePieceModel();
  SentencePieceModel(const SentencePieceModel&) = delete;
  SentencePieceModel& operator=(const SentencePieceModel&) = delete;

  std::vector<int64_t> encode(const std::string& text) const;
  std::string decode(const std::vector<int64_t>& ids) const;
  int64_t vocab_size() const;
  int64_t eos_id() const;
  int64_t piece_to_id(const std::string& piece) const;

 private:
  void* handle_;
};

// Runs SentencePieceTrainer::Train over in-memory sentences with key/value options.
void sentencepiece_train_in_memory(const std::vector<std::string>& sentences,
                                   const std::vector<std::pair<std::string, std::string>>& args);

}  // namespace spes
