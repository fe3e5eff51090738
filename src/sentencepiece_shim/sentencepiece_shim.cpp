// A small C interface over libsentencepiece, built as its own shared library and loaded with
// dlopen(RTLD_LOCAL | RTLD_DEEPBIND) by src/spes/data/sentencepiece_lib.cpp.
// Why: Debian's libsentencepiece bundles and exports its own copy of protobuf-lite. Linked into
// the same process as libtorch/gRPC (which use the system libprotobuf), the two copies
// interpose each other's symbols and the process crashes during static initialisation. Loaded
// this way, sentencepiece binds to its own protobuf and exposes nothing to the rest.
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

namespace {
void set_error(char* err, size_t len, const std::string& msg) {
  if (!err || len == 0) return;
  std::strncpy(err, msg.c_str(), len - 1);
  err[len - 1] = '\0';
}
}  // namespace

extern "C" {

void* spes_spm_load(const char* path, char* err, size_t err_len) {
  auto* p = new sentencepiece::SentencePieceProcessor();
  const auto st = p->Load(path);
  if (!st.ok()) {
    set_error(err, err_len, st.ToString());
    delete p;
    return nullptr;
  }
  return p;
}

void* spes_spm_load_bytes(const char* data, size_t len, char* err, size_t err_len) {
  auto* p = new sentencepiece::SentencePieceProcessor();
  const auto st = p->LoadFromSerializedProto(std::string(data, len));
  if (!st.ok()) {
    set_error(err, err_len, st.ToString());
    delete p;
    return nullptr;
  }
  return p;
}

void spes_spm_free(void* h) { delete static_cast<sentencepiece::SentencePieceProcessor*>(h); }

// Encodes text into ids; *ids is malloc'd (free with spes_spm_free_buffer). 0 on success.
int spes_spm_encode(void* h, const char* text, size_t len, int** ids, size_t* n) {
  std::vector<int> out;
  const auto st = static_cast<sentencepiece::SentencePieceProcessor*>(h)->Encode(
      std::string(text, len), &out);
  if (!st.ok()) return 1;
  *n = out.size();
  *ids = static_cast<int*>(std::malloc(sizeof(int) * (out.empty() ? 1 : out.size())));
  if (!out.empty()) std::memcpy(*ids, out.data(), sizeof(int) * out.size());
  return 0;
}

int spes_spm_decode(void* h, const int* ids, size_t n, char** text, size_t* len) {
  std::string out;
  const auto st = static_cast<sentencepiece::SentencePieceProcessor*>(h)->Decode(
      std::vector<int>(ids, ids + n), &out);
  if (!st.ok()) return 1;
  *len = out.size();
  *text = static_cast<char*>(std::malloc(out.size() + 1));
  std::memcpy(*text, out.data(), out.size());
  (*text)[out.size()] = '\0';
  return 0;
}

void spes_spm_free_buffer(void* p) { std::free(p); }

int spes_spm_vocab_size(void* h) {
  return static_cast<sentencepiece::SentencePieceProcessor*>(h)->GetPieceSize();
}
int spes_spm_eos_id(void* h) { return static_cast<sentencepiece::SentencePieceProcessor*>(h)->eos_id(); }
int spes_spm_piece_to_id(void* h, const char* piece) {
  return static_cast<sentencepiece::SentencePieceProcessor*>(h)->PieceToId(piece);
}

// Trains a model from a SentencePieceTrainer argument string. 0 on success.
int spes_spm_train(const char* args, char* err, size_t err_len) {
  const auto st = sentencepiece::SentencePieceTrainer::Train(args);
  if (!st.ok()) {
    set_error(err, err_len, st.ToString());
    return 1;
  }
  return 0;
}

// Trains from in-memory sentences with key/value trainer options. 0 on success.
int spes_spm_train_sentences(const char* const* sentences, size_t n, const char* const* keys,
                             const char* const* values, size_t n_args, char* err, size_t err_len) {
  class Iter : public sentencepiece::SentenceIterator {
   public:
    Iter(const char* const* s, size_t n) : s_(s), n_(n) { load(); }
    bool done() const override { return i_ >= n_; }
    void Next() override { ++i_; load(); }
    const std::string& value() const override { return cur_; }
    sentencepiece::util::Status status() const override { return {}; }
   private:
    void load() { if (i_ < n_) cur_ = s_[i_]; }
    const char* const* s_;
    size_t n_, i_ = 0;
    std::string cur_;
  } it(sentences, n);
  std::unordered_map<std::string, std::string> args;
  for (size_t i = 0; i < n_args; ++i) args[keys[i]] = values[i];
  const auto st = sentencepiece::SentencePieceTrainer::Train(args, &it);
  if (!st.ok()) {
    set_error(err, err_len, st.ToString());
    return 1;
  }
  return 0;
}

}  // extern "C"
