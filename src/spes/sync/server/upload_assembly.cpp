// Upload stream assembly from chunks (see upload_assembly.h).
#include "spes/sync/server/upload_assembly.h"

#include "spes/sync/wire/protocol.h"

namespace spes::sync {

UploadAssembly::UploadAssembly(uint64_t total_bytes, std::string origin)
    : total_(total_bytes), origin_(std::move(origin)) {}

std::string_view UploadAssembly::accept(uint64_t offset, std::string_view data,
                                        const std::string& checksum) {
  if (chunk_checksum(data) != checksum)  // transport damage: the sender may send it again
    sync_fail(SyncErrc::DataLoss, "{}: checksum mismatch in the chunk at offset {} ({} bytes); "
              "the chunk is corrupt", origin_, offset, data.size());
  if (data.size() > kMaxChunkBytes)
    sync_fail(SyncErrc::ResourceExhausted, "{}: upload chunk of {} bytes exceeds the {} byte "
              "limit", origin_, data.size(), kMaxChunkBytes);
  // A repeat of bytes already received is never applied twice.
  if (offset <= received_ && data.size() <= received_ - offset) return {};
  if (offset > received_)
    sync_fail(SyncErrc::InvalidArgument, "{}: chunk at offset {} but {} bytes were received so "
              "far (chunks must arrive in order)", origin_, offset, received_);
  const uint64_t skip = received_ - offset;
  const uint64_t n = data.size() - skip;
  if (n > total_ - received_)
    sync_fail(SyncErrc::InvalidArgument, "{}: upload runs past its declared {} bytes", origin_,
              total_);
  whole_.update(data.data() + skip, n);
  received_ += n;
  return std::string_view(data.data() + skip, n);
}

const std::string& UploadAssembly::checksum() {
  if (!complete())
    sync_fail(SyncErrc::DataLoss, "{}: upload ended after {} of {} bytes", origin_, received_,
              total_);
  if (digest_.empty()) digest_ = whole_.hex_digest();
  return digest_;
}

}  // namespace spes::sync
