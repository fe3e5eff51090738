// TokenCorpus: token shards opened memory-mapped and seen as one concatenated sequence of ids.
// Accepts, in any mix and order: (a) a directory prepared by `spes prepare` (manifest.json,
// format "spes-tokens-v1", uint16/uint32 shards), (b) raw reference shards: flat little-endian
// uint32 with no header (any extension, also the reference's header-less ".npy"), (c) real numpy
// .npy files (1-D, C order, little-endian u1/u2/u4/u8/i1/i2/i4/i8). On open every shard is
// checked (size, header, manifest counts) and scanned once for the largest id (and negative ids),
// which must be below the vocabulary size when one is known. Leaves out: compressed shards,
// big-endian data, writing (corpus_prepare.cpp writes shards).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace spes {

struct TokenShard {
  std::string path;
  std::string dtype;   // "uint16", "uint32", "int64", ...
  int64_t tokens = 0;
  int64_t start = 0;   // global offset of its first token
  std::string sha256;  // from the manifest; "" when unknown
};

class TokenCorpus {
 public:
  // `vocab_size` > 0: every id must be below it; -1: use the manifests' vocab_size, if any.
  explicit TokenCorpus(const std::vector<std::string>& paths, int64_t vocab_size = -1);
  ~TokenCorpus();
  TokenCorpus(TokenCorpus&&) noexcept;
  TokenCorpus& operator=(TokenCorpus&&) noexcept;

  int64_t total_tokens() const;
  // Copies ids [offset, offset + n) of the concatenation into out (range-checked).
  void read(int64_t offset, int64_t n, int64_t* out) const;
  const std::vector<TokenShard>& shards() const;
  int64_t vocab_size() const;      // the checked bound; -1 when unknown
  int64_t eos_token_id() const;    // from a manifest; -1 when unknown
  int64_t max_token_id() const;    // largest id present
  std::string tokenizer_path() const;  // tokenizer copied next to a manifest; "" when unknown
  // Recomputes the SHA-256 of every shard listed in a manifest; throws on a mismatch.
  void verify_checksums() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spes
