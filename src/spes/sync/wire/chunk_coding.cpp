// Lossless zstd coding of transfer chunks (see chunk_coding.h).
#include "spes/sync/wire/chunk_coding.h"

#include <zstd.h>

#include <memory>

#include "spes/sync/wire/protocol.h"

namespace spes::sync {
namespace {

struct CCtxFree {
  void operator()(ZSTD_CCtx* c) const { ZSTD_freeCCtx(c); }
};
struct DCtxFree {
  void operator()(ZSTD_DCtx* d) const { ZSTD_freeDCtx(d); }
};

// One context per thread: gRPC serves each stream on its own thread, and a context's tables
// (about 1 MiB at level 1) are set up once, not per chunk.
ZSTD_CCtx* thread_cctx() {
  thread_local std::unique_ptr<ZSTD_CCtx, CCtxFree> c(ZSTD_createCCtx());
  if (!c) sync_fail(SyncErrc::Internal, "zstd: cannot create a coding context (out of memory)");
  return c.get();
}

ZSTD_DCtx* thread_dctx() {
  thread_local std::unique_ptr<ZSTD_DCtx, DCtxFree> d(ZSTD_createDCtx());
  if (!d) sync_fail(SyncErrc::Internal, "zstd: cannot create a decoding context (out of memory)");
  return d.get();
}

}  // namespace

ChunkEncoding pack_chunk(std::string_view raw, std::string* packed) {
  packed->clear();
  if (raw.empty()) return ChunkEncoding::Raw;
  // Only a frame smaller than the chunk is worth sending: the bound is raw.size() - 1, and
  // zstd reports an error (dstSize_tooSmall) when the frame would not fit.
  packed->resize(raw.size() - 1);
  const size_t n = ZSTD_compressCCtx(thread_cctx(), packed->data(), packed->size(), raw.data(),
                                     raw.size(), kChunkZstdLevel);
  if (ZSTD_isError(n)) {
    packed->clear();
    return ChunkEncoding::Raw;
  }
  packed->resize(n);
  return ChunkEncoding::Zstd;
}

std::string_view unpack_chunk(uint32_t encoding, std::string_view data, uint64_t max_bytes,
                              std::string* scratch, const std::string& what) {
  if (encoding == static_cast<uint32_t>(ChunkEncoding::Raw)) return data;
  if (encoding != static_cast<uint32_t>(ChunkEncoding::Zstd))
    sync_fail(SyncErrc::InvalidArgument, "{}: unknown chunk encoding {} (this build knows 0 = "
              "raw and 1 = zstd); update the sender or the receiver so both speak protocol {}",
              what, encoding, kProtocolVersion);
  const unsigned long long size = ZSTD_getFrameContentSize(data.data(), data.size());
  if (size == ZSTD_CONTENTSIZE_ERROR || size == ZSTD_CONTENTSIZE_UNKNOWN)
    sync_fail(SyncErrc::DataLoss, "{}: the zstd chunk has no valid frame header with its "
              "content size; it is sent again", what);
  if (size > max_bytes)
    sync_fail(SyncErrc::ResourceExhausted, "{}: the zstd chunk claims {} bytes, above the {} "
              "a chunk may hold", what, size, max_bytes);
  scratch->resize(static_cast<size_t>(size));
  const size_t n = ZSTD_decompressDCtx(thread_dctx(), scratch->data(), scratch->size(),
                                       data.data(), data.size());
  if (ZSTD_isError(n) || n != size) {
    scratch->clear();
    sync_fail(SyncErrc::DataLoss, "{}: the zstd chunk does not decode to the {} bytes its "
              "header claims ({}); it is sent again", what, size,
              ZSTD_isError(n) ? ZSTD_getErrorName(n) : "a different size");
  }
  return *scratch;
}

}  // namespace spes::sync
