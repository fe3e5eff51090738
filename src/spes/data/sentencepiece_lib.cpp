// dlopen-based binding to the SentencePiece shim (see sentencepiece_lib.h).
#include "spes/data/sentencepiece_lib.h"

#include <dlfcn.h>

#include <mutex>

#include "spes/common/error.h"
#include "spes/common/shared_module.h"

#ifndef SPES_SP_SHIM_BUILD_PATH
#define SPES_SP_SHIM_BUILD_PATH ""
#endif
#ifndef SPES_SP_SHIM_INSTALL_PATH
#define SPES_SP_SHIM_INSTALL_PATH ""
#endif

namespace spes {
namespace {

struct ShimApi {
  void* (*load)(const char*, char*, size_t);
  void (*free_model)(void*);
  int (*encode)(void*, const char*, size_t, int**, size_t*);
  int (*decode)(void*, const int*, size_t, char**, size_t*);
  void (*free_buffer)(void*);
  int (*vocab_size)(void*);
  int (*eos_id)(void*);
  int (*piece_to_id)(void*, const char*);
  void* (*load_bytes)(const char*, size_t, char*, size_t);
  int (*train)(const char* const*, size_t, const char* const*, const char* const*, size_t, char*,
               size_t);
};

const SharedModule& shim_module() {
  static const SharedModule m{"libspes_sentencepiece.so", "SPES_SENTENCEPIECE_SHIM",
                              SPES_SP_SHIM_BUILD_PATH, SPES_SP_SHIM_INSTALL_PATH};
  return m;
}

const ShimApi& shim() {
  static ShimApi api{};
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    try {
      const SharedModule& m = shim_module();
      void* h = open_shared_module(m, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
      auto sym = [&](const char* name) { return shared_module_symbol(h, m, name); };
      api.load = reinterpret_cast<decltype(api.load)>(sym("spes_spm_load"));
      api.free_model = reinterpret_cast<decltype(api.free_model)>(sym("spes_spm_free"));
      api.encode = reinterpret_cast<decltype(api.encode)>(sym("spes_spm_encode"));
      api.decode = reinterpret_cast<decltype(api.decode)>(sym("spes_spm_decode"));
      api.free_buffer = reinterpret_cast<decltype(api.free_buffer)>(sym("spes_spm_free_buffer"));
      api.vocab_size = reinterpret_cast<decltype(api.vocab_size)>(sym("spes_spm_vocab_size"));
      api.eos_id = reinterpret_cast<decltype(api.eos_id)>(sym("spes_spm_eos_id"));
      api.piece_to_id = reinterpret_cast<decltype(api.piece_to_id)>(sym("spes_spm_piece_to_id"));
      api.load_bytes = reinterpret_cast<decltype(api.load_bytes)>(sym("spes_spm_load_bytes"));
      api.train = reinterpret_cast<decltype(api.train)>(sym("spes_spm_train_sentences"));
    } catch (const Error& e) {
      error = e.what();
    }
  });
  SPES_CHECK(error.empty(), "SentencePiece: {}", error);
  return api;
}

}  // namespace

SentencePieceModel::SentencePieceModel(const std::string& path) {
  char err[512] = {0};
  handle_ = shim().load(path.c_str(), err, sizeof err);
  SPES_CHECK(handle_, "cannot load SentencePiece model '{}': {}", path, err);
}

SentencePieceModel::SentencePieceModel(const std::string& bytes, const std::string& origin) {
  char err[512] = {0};
  handle_ = shim().load_bytes(bytes.data(), bytes.size(), err, sizeof err);
  SPES_CHECK(handle_, "'{}' is neither a Hugging Face tokenizer.json (JSON object with \"model\") "
             "nor a SentencePiece model ({})", origin, err);
}

SentencePieceModel::~SentencePieceModel() {
  if (handle_) shim().free_model(handle_);
}

std::vector<int64_t> SentencePieceModel::encode(const std::string& text) const {
  int* ids = nullptr;
  size_t n = 0;
  SPES_CHECK(shim().encode(handle_, text.data(), text.size(), &ids, &n) == 0,
             "SentencePiece failed to encode a text of {} bytes", text.size());
  std::vector<int64_t> out(ids, ids + n);
  shim().free_buffer(ids);
  return out;
}

std::string SentencePieceModel::decode(const std::vector<int64_t>& ids) const {
  std::vector<int> in(ids.begin(), ids.end());
  char* text = nullptr;
  size_t n = 0;
  SPES_CHECK(shim().decode(handle_, in.data(), in.size(), &text, &n) == 0,
             "SentencePiece failed to decode {} ids (id out of range?)", ids.size());
  std::string out(text, n);
  shim().free_buffer(text);
  return out;
}

int64_t SentencePieceModel::vocab_size() const { return shim().vocab_size(handle_); }
int64_t SentencePieceModel::eos_id() const { return shim().eos_id(handle_); }
int64_t SentencePieceModel::piece_to_id(const std::string& piece) const {
  return shim().piece_to_id(handle_, piece.c_str());
}

void sentencepiece_train_in_memory(const std::vector<std::string>& sentences,
                                   const std::vector<std::pair<std::string, std::string>>& args) {
  std::vector<const char*> sp, keys, values;
  for (const auto& s : sentences) sp.push_back(s.c_str());
  for (const auto& [k, v] : args) keys.push_back(k.c_str()), values.push_back(v.c_str());
  char err[1024] = {0};
  SPES_CHECK(shim().train(sp.data(), sp.size(), keys.data(), values.data(), keys.size(), err,
                          sizeof err) == 0,
             "SentencePiece training failed: {}", err);
}

}  // namespace spes
