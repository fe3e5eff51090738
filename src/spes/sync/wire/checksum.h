// Transport checksums of the sync protocol: XXH3-128 (xxHash) of each chunk and of each whole
// upload stream, as 32 lowercase hex digits (the output of `xxh128sum`). They detect damage in
// transit and in staged files (a chunk is sent again, a resumed upload restarts), not forgery:
// who may send what is settled by authentication (auth.h) and the upload checks. A
// non-cryptographic checksum because every byte of every round passes through it on both
// sides: SHA-256 ran at about 1.9 GB/s here and was a quarter of a round's CPU time
// (docs/PERFORMANCE.md). The published model's identity stays SHA-256
// (ParamRegistry::weights_sha256).
#pragma once
#include <memory>
#include <string>
#include <string_view>

namespace spes::sync {

// Hex XXH3-128 of `data`.
std::string chunk_checksum(std::string_view data);

// The same checksum of a stream fed in pieces (equal to chunk_checksum of their concatenation).
class StreamChecksum {
 public:
  StreamChecksum();
  ~StreamChecksum();
  StreamChecksum(const StreamChecksum&) = delete;
  StreamChecksum& operator=(const StreamChecksum&) = delete;
  void update(const void* data, size_t n);
  std::string hex_digest() const;  // of the bytes so far; the stream may go on

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Hex XXH3-128 of a file's contents, read a piece at a time. Throws (naming the file) when it
// cannot be read.
std::string file_checksum(const std::string& path);

}  // namespace spes::sync
