// Server-side assembly of one upload stream from its chunks, without what the bytes mean: each
// chunk's checksum (wire/checksum.h), the chunk size bound, order (a chunk wholly before the
// bytes received so far is a repeat and ignored; one overlapping their end contributes only its
// new bytes; a gap is refused), the declared total, and the running checksum of the whole
// stream. One object lives as long as the upload, across a resumed stream. Used by the upload streams
// (upload_staging.cpp) and the protocol fuzz target (tests/fuzz). Leaves out: parsing the
// bytes (framing.h).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

#include "spes/sync/wire/checksum.h"

namespace spes::sync {

class UploadAssembly {
 public:
  // `origin` names the upload in errors (e.g. "node 1 round 3").
  UploadAssembly(uint64_t total_bytes, std::string origin);
  // Checks a chunk and returns the bytes it adds to the stream (empty for a repeat); they are
  // counted as received. Throws SyncError: DataLoss (checksum mismatch: transport damage),
  // ResourceExhausted (chunk above kMaxChunkBytes), InvalidArgument (a gap before the chunk, or
  // bytes past the declared total).
  std::string_view accept(uint64_t offset, std::string_view data, const std::string& checksum);
  uint64_t total() const { return total_; }
  uint64_t received() const { return received_; }
  bool complete() const { return received_ == total_; }
  // Checksum of the whole stream. Throws SyncError(DataLoss) unless complete.
  const std::string& checksum();

 private:
  uint64_t total_, received_ = 0;
  std::string origin_, digest_;
  StreamChecksum whole_;
};

}  // namespace spes::sync
