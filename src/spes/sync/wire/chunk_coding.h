// Lossless coding of transfer chunks on the wire (docs/PROTOCOL.md, "Chunk coding"): a chunk's
// bytes travel raw or as one zstd frame, whichever is smaller, both ways (uploads and
// downloads). The stream itself, its offsets, its checksums, the staged uploads and the
// published files stay raw: coding exists only between the two ends of one message. What it
// gains (measured with zstd level 1 on this project's files, docs/PERFORMANCE.md): int8 deltas
// about 3%, bf16 deltas about 21%, fp32 weights about 7%, at about 600 MB/s to code and
// 2 GB/s to decode on one core. Leaves out: whether a node uses it (spes_config.wire_coding).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace spes::sync {

// The `encoding` field of UploadChunk and DownloadChunk.
enum class ChunkEncoding : uint32_t { Raw = 0, Zstd = 1 };

// The zstd level used to code chunks: level 1 keeps coding faster than any internet link.
constexpr int kChunkZstdLevel = 1;

// Codes `raw` into *packed as a zstd frame (its content size recorded in the frame) when that
// is smaller than `raw`, and returns Zstd; otherwise leaves *packed empty and returns Raw (the
// chunk goes as it is). Reuses a per-thread coding context.
ChunkEncoding pack_chunk(std::string_view raw, std::string* packed);

// A chunk as it arrived -> its raw bytes: `data` itself when it travelled raw; a zstd frame is
// decoded into *scratch (reused from chunk to chunk), which must record a content size of at
// most `max_bytes` and decode to exactly that many bytes (a hostile frame never makes the
// receiver allocate more than max_bytes or read past the data). The view lives as long as
// `data` or *scratch.
// Throws SyncError: InvalidArgument for an unknown encoding, ResourceExhausted for a frame
// that claims more than max_bytes, DataLoss for a frame that does not decode (transport
// damage: the chunk is sent again). `what` names the chunk in the message.
std::string_view unpack_chunk(uint32_t encoding, std::string_view data, uint64_t max_bytes,
                              std::string* scratch, const std::string& what);

}  // namespace spes::sync
