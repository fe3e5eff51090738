// Entry functions of the fuzz targets (see fuzz_entries.h).
#include "fuzz/fuzz_entries.h"

#include <cstring>

#include "spes/common/build_features.h"
#include "spes/common/error.h"
#include "spes/io/config.h"
#include "spes/io/safetensors.h"
#if SPES_WITH_SYNC
#include "spes/sync/server/upload_assembly.h"
#include "spes/sync/wire/checksum.h"
#include "spes/sync/wire/chunk_coding.h"
#include "spes/sync/wire/framing.h"
#include "spes/sync/wire/protocol.h"
#include "spes_sync.pb.h"
#endif

namespace spes::fuzz {
namespace {

// Bound of a fuzzed upload's declared size. The server bounds it by the uploading node's exact
// tensor bytes + the header limit (RoundState::begin_upload), which needs a model; here the
// bound is fixed, large enough for the seeds.
constexpr uint64_t kMaxFuzzUploadBytes = 1ull << 20;

// Runs `f`; a spes::Error is a clean refusal.
template <class F>
void clean(F&& f) {
  try {
    f();
  } catch (const Error&) {
  }
}

}  // namespace

void fuzz_safetensors(const uint8_t* data, size_t size) {
  clean([&] {
    Metadata md;
    const NamedTensors t =
        safetensors_parse(std::string(reinterpret_cast<const char*>(data), size), &md, "fuzz");
    for (const auto& [name, v] : t) (void)v.numel();
  });
}

void fuzz_config(const uint8_t* data, size_t size) {
  std::vector<std::string> pieces(1);
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == 0) pieces.emplace_back();
    else pieces.back().push_back(static_cast<char>(data[i]));
  }
  const std::vector<std::string> overrides(pieces.begin() + 1, pieces.end());
  clean([&] {
    const Config c = config_parse(pieces[0], overrides, "fuzz.yaml");
    (void)config_to_yaml(c);
  });
}

#if SPES_WITH_SYNC
void fuzz_upload_stream(const uint8_t* data, size_t size) {
  namespace pb = ::spes::sync::v1;
  using namespace spes::sync;
  clean([&] {
    std::vector<pb::UploadChunk> chunks;
    for (size_t pos = 0; pos + 4 <= size;) {
      uint32_t n = 0;
      std::memcpy(&n, data + pos, 4);  // little-endian hosts only (x86-64, aarch64)
      pos += 4;
      if (n > size - pos) fail("record {} of the upload stream runs past the input", chunks.size());
      pb::UploadChunk c;
      if (!c.ParseFromArray(data + pos, static_cast<int>(n)))
        fail("record {} of the upload stream is not an UploadChunk", chunks.size());
      chunks.push_back(std::move(c));
      pos += n;
    }
    // What the gRPC handler does with the stream (server.cpp, Upload).
    if (chunks.empty()) sync_fail(SyncErrc::InvalidArgument, "empty upload stream");
    const pb::UploadChunk& first = chunks[0];
    if (first.resume_query()) return;  // answered at once, nothing parsed
    const uint64_t total = first.total_bytes();
    if (total < 8 || total > kMaxFuzzUploadBytes)
      sync_fail(SyncErrc::ResourceExhausted, "an upload of {} bytes is impossible", total);
    UploadAssembly assembly(total, "fuzz upload");
    SafetensorsStreamReader reader(total, "fuzz upload", [](const StreamHeader&) {}, nullptr,
                                   kMaxHeaderBytes);
    double sum = 0;
    reader.set_slice_handler([&](const StreamEntry&, int64_t, const torch::Tensor& run, bool) {
      if (run.numel() > 0) sum += run.to(torch::kFloat64).sum().item<double>();
    });
    std::string whole_checksum, scratch;
    for (pb::UploadChunk& c : chunks) {
      if (c.node().node_id() != first.node().node_id() || c.round() != first.round() ||
          c.total_bytes() != total || c.resume_query())
        sync_fail(SyncErrc::InvalidArgument, "upload chunks disagree on node, round or size");
      if (!c.upload_checksum().empty()) whole_checksum = c.upload_checksum();
      // A coded chunk is decoded first, as UploadStaging::chunk does; its checksum is of the
      // raw bytes (filled in when the input has none, so that the fuzzer reaches the parser).
      const std::string_view raw =
          unpack_chunk(c.encoding(), c.data(), kMaxChunkBytes, &scratch, "fuzz upload chunk");
      if (c.checksum().empty()) c.set_checksum(chunk_checksum(raw));
      const std::string_view fresh = assembly.accept(c.offset(), raw, c.checksum());
      reader.feed(fresh.data(), fresh.size());
    }
    const std::string sha = assembly.checksum();
    if (!whole_checksum.empty() && whole_checksum != sha)
      sync_fail(SyncErrc::DataLoss, "the upload's bytes hash to {}, not {}", sha, whole_checksum);
    reader.finish();
  });
}
#endif

// upload_stream and round_rpc parse the gRPC messages: only in builds with the sync side
// (SPES_WITH_SYNC).
const std::vector<std::string>& fuzz_target_names() {
  static const std::vector<std::string> names = {"safetensors", "config"
#if SPES_WITH_SYNC
                                                 , "upload_stream", "round_rpc", "round_rpc_int8"
#endif
  };
  return names;
}

void fuzz_run(const std::string& target, const uint8_t* data, size_t size) {
  if (target == "safetensors") return fuzz_safetensors(data, size);
  if (target == "config") return fuzz_config(data, size);
#if SPES_WITH_SYNC
  if (target == "upload_stream") return fuzz_upload_stream(data, size);
  if (target == "round_rpc") return fuzz_round_rpc(data, size);
  if (target == "round_rpc_int8") return fuzz_round_rpc_int8(data, size);
#endif
  fail("unknown fuzz target '{}' (safetensors, config, upload_stream, round_rpc, "
       "round_rpc_int8)", target);
}

}  // namespace spes::fuzz
