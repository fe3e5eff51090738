// Corpus preparation (see corpus_prepare.h): document readers, a streaming shard writer with
// incremental SHA-256, and batches of documents tokenized by a pool of threads that pick
// documents one at a time and store results by index, so the output order never depends on
// scheduling.
#include "spes/data/corpus_prepare.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/common/timing.h"
#include "spes/data/sentencepiece_tokenizer.h"
#include "spes/data/tokenizer.h"
#include "spes/io/files.h"

namespace spes {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

bool is_jsonl(const std::string& path) {
  return ends_with(path, ".jsonl") || ends_with(path, ".ndjson");
}

bool is_blank(const std::string& line) { return line.find_first_not_of(" \t\r\f\v") == std::string::npos; }

// Bytes per stored token id: uint16 when the vocabulary fits, else uint32.
int token_bytes(int64_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

// Writes ids as uint16/uint32 into DIR/tokens-NNNNN.bin, starting a new file at the cap.
class ShardWriter {
 public:
  ShardWriter(std::string dir, int elem, int64_t cap) : dir_(std::move(dir)), elem_(elem), cap_(cap) {}
  ~ShardWriter() {
    if (f_) std::fclose(f_);
  }
  void append(const int64_t* ids, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      if (!f_ || count_ == cap_) open_next();
      if (elem_ == 2) {
        uint16_t v = static_cast<uint16_t>(ids[i]);
        buf_.append(reinterpret_cast<const char*>(&v), 2);
      } else {
        uint32_t v = static_cast<uint32_t>(ids[i]);
        buf_.append(reinterpret_cast<const char*>(&v), 4);
      }
      ++count_;
      if (buf_.size() >= (1 << 20)) flush();
    }
  }
  void finish() {
    if (f_) close_current();
  }
  const json& files() const { return files_; }

 private:
  void open_next() {
    if (f_) close_current();
    name_ = fmt::format("tokens-{:05d}.bin", files_.size());
    path_ = dir_ + "/" + name_;
    f_ = std::fopen(path_.c_str(), "wb");
    SPES_CHECK(f_ != nullptr, "cannot create '{}': {}", path_, std::strerror(errno));
    count_ = 0;
    sha_ = std::make_unique<Sha256>();
  }
  void flush() {
    if (buf_.empty()) return;
    sha_->update(buf_.data(), buf_.size());
    SPES_CHECK(std::fwrite(buf_.data(), 1, buf_.size(), f_) == buf_.size(),
               "cannot write '{}': {}", path_, std::strerror(errno));
    buf_.clear();
  }
  void close_current() {
    flush();
    SPES_CHECK(std::fflush(f_) == 0 && ::fsync(fileno(f_)) == 0, "cannot write '{}': {}", path_,
               std::strerror(errno));
    std::fclose(f_);
    f_ = nullptr;
    files_.push_back({{"name", name_}, {"tokens", count_}, {"sha256", sha_->hex_digest()}});
  }

  std::string dir_, name_, path_, buf_;
  int elem_;
  int64_t cap_, count_ = 0;
  std::FILE* f_ = nullptr;
  std::unique_ptr<Sha256> sha_;
  json files_ = json::array();
};

// Tokenizes docs[i] into out[i] with `threads` workers.
void encode_batch(const Tokenizer& tok, const std::vector<std::string>& docs,
                  std::vector<std::vector<int64_t>>& out, int64_t threads) {
  out.assign(docs.size(), {});
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::mutex error_mu;
  auto work = [&] {
    try {
      for (size_t i; (i = next.fetch_add(1)) < docs.size();) out[i] = tok.encode(docs[i]);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mu);
      if (!error) error = std::current_exception();
      next = docs.size();
    }
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace

void corpus_read_documents(const std::string& path, const PrepareOptions& opt,
                           const std::function<void(std::string&&)>& fn) {
  std::ifstream in(path, std::ios::binary);
  SPES_CHECK(in.good(), "cannot read input '{}' (does it exist?)", path);
  const int c0 = in.peek();
  SPES_CHECK(c0 != 0x1f && c0 != 0x28, "input '{}' looks compressed (gzip/zstd); decompress it "
             "first", path);
  std::string line, doc;
  if (is_jsonl(path)) {
    for (int64_t ln = 1; std::getline(in, line); ++ln) {
      if (is_blank(line)) continue;
      json j;
      try {
        j = json::parse(line);
      } catch (const json::exception& e) {
        fail("{}:{}: not valid JSON: {}", path, ln, e.what());
      }
      auto it = j.find(opt.jsonl_field);
      SPES_CHECK(j.is_object() && it != j.end() && it->is_string(),
                 "{}:{}: expected an object with a string field '{}' (set it with --jsonl-field)",
                 path, ln, opt.jsonl_field);
      std::string text = it->get<std::string>();
      if (!is_blank(text)) fn(std::move(text));
    }
    return;
  }
  auto emit = [&] {
    if (!doc.empty()) fn(std::move(doc));
    doc.clear();
  };
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (is_blank(line)) {
      if (opt.doc_per_file) { if (!doc.empty()) doc += '\n'; }
      else emit();
      continue;
    }
    if (!doc.empty()) doc += '\n';
    doc += line;
  }
  if (opt.doc_per_file)
    while (!doc.empty() && doc.back() == '\n') doc.pop_back();  // trailing blank lines
  emit();
}

namespace {

// The output directory, normalised, once the options are checked: inputs that exist, one way
// to get a tokenizer, and an output that is new, empty or an earlier prepared directory.
std::string checked_out_dir(const PrepareOptions& opt) {
  SPES_CHECK(!opt.inputs.empty(), "prepare: no input files given");
  for (const auto& in : opt.inputs)
    SPES_CHECK(fs::is_regular_file(in), "prepare: input '{}' does not exist or is not a file", in);
  SPES_CHECK(!opt.out_dir.empty(), "prepare: no output directory given");
  SPES_CHECK(opt.tokenizer.empty() != (opt.vocab_size <= 0),
             "prepare: give either a tokenizer file or a vocabulary size to train one, not {}",
             opt.tokenizer.empty() ? "neither" : "both");
  SPES_CHECK(opt.shard_tokens > 0, "prepare: shard size must be positive");
  const std::string out = fs::path(opt.out_dir).lexically_normal().string();
  SPES_CHECK(!fs::exists(out) || fs::is_empty(out) || fs::exists(out + "/manifest.json"),
             "prepare: '{}' exists and is not a prepared token directory; refusing to replace "
             "it (choose a new or empty directory)", out);
  return out;
}

// The given tokenizer, its file copied into `dir` (readable by all, like the shards).
std::unique_ptr<Tokenizer> copy_tokenizer(const PrepareOptions& opt, const std::string& dir,
                                          PrepareSummary& sum) {
  std::unique_ptr<Tokenizer> tok = tokenizer_load(opt.tokenizer);
  sum.tokenizer_file = tok->kind() == "hf-bpe" ? "tokenizer.json" : "tokenizer.model";
  const std::string dst = dir + "/" + sum.tokenizer_file;
  fs::copy_file(opt.tokenizer, dst);
  fs::permissions(dst, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                           fs::perms::others_read);
  return tok;
}

// A SentencePiece tokenizer of opt.vocab_size trained on a sample of the inputs' lines, into
// `dir`.
std::unique_ptr<Tokenizer> train_tokenizer(const PrepareOptions& opt, const std::string& dir,
                                           PrepareSummary& sum) {
  const auto t0 = std::chrono::steady_clock::now();
  SentenceSampler sampler;
  for (const auto& in : opt.inputs)
    corpus_read_documents(in, opt, [&](std::string&& d) { sampler.add_lines(d); });
  sentencepiece_train_sentences(sampler.take(), opt.vocab_size, dir + "/tokenizer",
                                opt.tokenizer_type);
  sum.tokenizer_file = "tokenizer.model";
  std::unique_ptr<Tokenizer> tok = tokenizer_load(dir + "/tokenizer.model");
  sum.tokenizer_seconds = seconds_since(t0);
  return tok;
}

// Every document of the inputs tokenized (in batches of up to 16 MiB or 16384 documents, on
// `threads` cores) with EOS after each, into shards in `dir`; returns the shard files (name,
// tokens, sha256) and counts documents and tokens into `sum`.
json write_token_shards(const PrepareOptions& opt, const Tokenizer& tok, const std::string& dir,
                        int64_t threads, PrepareSummary& sum) {
  ShardWriter writer(dir, token_bytes(sum.vocab_size), opt.shard_tokens);
  std::vector<std::string> batch;
  std::vector<std::vector<int64_t>> ids;
  size_t batch_bytes = 0;
  const int64_t eos = sum.eos_id;
  auto flush = [&] {
    encode_batch(tok, batch, ids, threads);
    for (const auto& v : ids) {
      writer.append(v.data(), v.size());
      writer.append(&eos, 1);
      sum.tokens += static_cast<int64_t>(v.size()) + 1;
    }
    sum.documents += static_cast<int64_t>(batch.size());
    batch.clear();
    batch_bytes = 0;
  };
  for (const auto& in : opt.inputs) {
    corpus_read_documents(in, opt, [&](std::string&& d) {
      batch_bytes += d.size();
      batch.push_back(std::move(d));
      if (batch_bytes >= (size_t(16) << 20) || batch.size() >= 16384) flush();
    });
  }
  flush();
  writer.finish();
  for (const auto& f : writer.files()) sum.files.push_back(f["name"].get<std::string>());
  return writer.files();
}

// DIR/manifest.json ("spes-tokens-v1"): what the shards hold and how they were made.
void write_manifest(const PrepareOptions& opt, const Tokenizer& tok, const json& files,
                    const PrepareSummary& sum, const std::string& dir) {
  json inputs = json::array();
  for (const auto& in : opt.inputs) inputs.push_back(fs::path(in).filename().string());
  const json manifest = {{"format", "spes-tokens-v1"}, {"dtype", sum.dtype},
                         {"vocab_size", sum.vocab_size}, {"eos_token_id", sum.eos_id},
                         {"tokenizer", sum.tokenizer_file}, {"tokenizer_kind", tok.kind()},
                         {"documents", sum.documents}, {"tokens", sum.tokens},
                         {"files", files}, {"inputs", inputs},
                         {"created_by", "spes prepare"}};
  file_write_atomic(dir + "/manifest.json", manifest.dump(2) + "\n");
}

}  // namespace

PrepareSummary corpus_prepare(const PrepareOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string out = checked_out_dir(opt);
  const int64_t threads =
      opt.threads > 0 ? opt.threads : std::max<int64_t>(1, std::thread::hardware_concurrency());
  // Assembled under a temporary name, renamed into place once complete.
  const std::string tmp = fmt::format("{}.tmp-{}", out, ::getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  PrepareSummary sum;
  try {
    const std::unique_ptr<Tokenizer> tok =
        opt.tokenizer.empty() ? train_tokenizer(opt, tmp, sum) : copy_tokenizer(opt, tmp, sum);
    sum.vocab_size = tok->vocab_size();
    sum.eos_id = tok->eos_id();
    sum.dtype = token_bytes(sum.vocab_size) == 2 ? "uint16" : "uint32";
    const json files = write_token_shards(opt, *tok, tmp, threads, sum);
    SPES_CHECK(sum.documents > 0, "prepare: the inputs hold no text");
    write_manifest(opt, *tok, files, sum, tmp);
    dir_fsync(tmp);
    dir_commit(tmp, out);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw;
  }
  sum.seconds = seconds_since(t0);
  return sum;
}

}  // namespace spes
