// The round_rpc fuzz targets (fuzz_entries.h): the sync server's handling of every RPC
// (src/spes/sync/server/rpc_calls.cpp, the code behind the gRPC handlers) and its round logic
// (RoundState: membership, upload checks and staging, update bounds, aggregation,
// publication, downloads) with a real model: the tiny MoE of the sync tests, 4 nodes (one
// expert each), in a fresh server directory per input. round_rpc runs the server with
// uncompressed uploads; round_rpc_int8 with spes_config.compression int8, where an honest
// upload is the node's int8 delta from the published model with its scales (what the server
// rebuilds, checks and publishes as a delta file), and downloads may be deltas. Each input is
// a sequence of calls, records of [u8 op][u8 caller][u16 little-endian n][n bytes]:
//   op % 9 = 0 Join       the bytes are a JoinRequest (none: the caller's honest join)
//            1 Upload     the bytes are UploadChunk records [u16 n][message]; a chunk without
//                         a checksum gets its correct one (the fuzzer would not guess it)
//            2 Upload     the caller's real upload for the collecting round (as the node
//                         joined with its honest join; int8: its delta), in 1000-byte chunks,
//                         with the bytes' [u32 offset][u8 xor] edits applied
//            3 WaitRound  4 Download  5 Leave  6 Heartbeat   (the bytes are the request;
//                         waits are cut to 0 ms, downloads to 64 chunks)
//            7 Status     8 tick
//   caller % 5 = the node whose credentials the call carries (4: an id outside the run).
// After every call the server must tick without throwing and its status and round history
// must serialise as strict JSON. After the last one the honest nodes join again and upload
// the next round, which must publish, and a full download must reproduce the published digest.
// A refusal is a spes::Error; a broken invariant throws std::logic_error, which FuzzCases
// reports and libFuzzer treats as a crash.
#include "fuzz/fuzz_entries.h"

#include "spes/common/build_features.h"

#if SPES_WITH_SYNC
#include <cstring>
#include <memory>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "spes/sync/server/rpc_calls.h"
#include "spes/sync/wire/chunk_coding.h"
#include "sync/compressed_upload_parts.h"
#include "sync/sync_test_util.h"

namespace spes::fuzz {
namespace {

using namespace spes::sync;
using namespace spes::sync::testing;

constexpr int kNodes = 4;

void invariant(bool ok, const std::string& what) {
  if (!ok) throw std::logic_error("round_rpc invariant broken: " + what);
}

// One server setup: its config and the honest nodes (their models are never changed;
// downloads go to a fresh node).
struct Setup {
  Config cfg;
  Compression compression = Compression::None;
  std::vector<std::unique_ptr<FakeNode>> nodes;

  explicit Setup(Compression c)
      : cfg(tiny_config({"spes_config.num_peers=4", std::string("spes_config.compression=") +
                                                         Choice<Compression>(c).name()})),
        compression(c) {
    for (int k = 0; k < kNodes; ++k) nodes.push_back(std::make_unique<FakeNode>(cfg, k, k + 1));
  }
  const FakeNode& honest(int64_t i) const { return *nodes[static_cast<size_t>(i)]; }
};

const Setup& setup_of(Compression c) {
  static const Setup plain(Compression::None), int8(Compression::Int8);
  return c == Compression::None ? plain : int8;
}

template <class F>
void refusable(F&& f) {
  try {
    f();
  } catch (const Error&) {
  }
}

void check_serialisable(const RoundState& st) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& n : st.status().nodes) j.push_back({{"detail", n.detail}, {"state", n.state}});
  for (const auto& h : st.round_history()) j.push_back(h);
  pb::StatusReply rep;
  call_status(st, &rep);
  j.push_back(rep.publish_error());
  try {
    (void)j.dump();  // throws on invalid UTF-8
  } catch (const std::exception& e) {
    invariant(false, std::string("status does not serialise: ") + e.what());
  }
}

// The Upload call of a stream of these chunks.
void send_chunks(RoundState& st, const NodeId& who, const std::vector<pb::UploadChunk>& chunks) {
  size_t next = 0;
  pb::UploadReply rep;
  call_upload(st, who, [&](pb::UploadChunk* c) {
    if (next == chunks.size()) return false;
    *c = chunks[next++];
    return true;
  }, &rep);
}

// Streams `bytes` as the Upload of `who` for `round`, in 1000-byte chunks with right checksums.
void upload_bytes(const Setup& su, RoundState& st, const NodeId& who, int64_t round,
                  const std::string& bytes) {
  std::vector<pb::UploadChunk> chunks;
  for (uint64_t off = 0; off == 0 || off < bytes.size(); off += 1000) {
    pb::UploadChunk& c = chunks.emplace_back();
    c.mutable_node()->set_node_id(who.node_id);
    c.mutable_node()->set_incarnation(who.incarnation);
    c.set_round(round);
    c.set_step(round * su.cfg.spes_config.sync_steps);
    c.set_total_bytes(bytes.size());
    c.set_offset(off);
    c.set_data(bytes.substr(off, 1000));
    c.set_checksum(chunk_checksum(c.data()));
  }
  send_chunks(st, who, chunks);
}

// What node `n` uploads for `round`: the published values moved by a node-specific amount,
// as fp32 tensors, or with int8 compression as the delta (int8 values and their scales).
std::string honest_upload(const Setup& su, const FakeNode& n, const RoundState& st,
                          int64_t round) {
  const double delta = 0.001 * (n.id.node_id + 1);
  std::string bytes;
  if (su.compression == Compression::None) {
    const SafetensorsStreamWriter w = upload_of(n, round, trained(n, st, delta));
    w.read(0, w.total_bytes(), &bytes);
    return bytes;
  }
  const NamedTensors parts =
      compressed_upload_parts(n, su.compression, [&](const RegistryEntry& e) {
        return torch::full(e.tensor.sizes(), delta);
      });
  UploadMeta m{n.id.node_id, round, round * su.cfg.spes_config.sync_steps, 80, n.id.incarnation,
               n.reg->fingerprint()};
  m.compression = su.compression;
  const SafetensorsStreamWriter w = SafetensorsStreamWriter::as_stored(parts, upload_metadata(m));
  w.read(0, w.total_bytes(), &bytes);
  return bytes;
}

template <class Message>
bool parse(Message* m, const uint8_t* p, size_t n) {
  return m->ParseFromArray(p, static_cast<int>(n));
}

void one_call(const Setup& su, RoundState& st, int op, const NodeId& who, const uint8_t* p,
              size_t n) {
  switch (op) {
    case 0: {
      if (n == 0) {
        if (who.node_id < kNodes) st.join(su.honest(who.node_id).join_info());
        return;
      }
      pb::JoinRequest req;
      pb::JoinReply rep;
      if (parse(&req, p, n)) call_join(st, who, req, &rep);
      return;
    }
    case 1: {
      std::vector<pb::UploadChunk> chunks;
      for (size_t pos = 0; pos + 2 <= n;) {
        uint16_t len = 0;
        std::memcpy(&len, p + pos, 2);  // little-endian hosts only (x86-64, aarch64)
        pos += 2;
        if (len > n - pos) break;
        pb::UploadChunk c;
        if (!parse(&c, p + pos, len)) break;
        if (c.checksum().empty()) c.set_checksum(chunk_checksum(c.data()));
        chunks.push_back(std::move(c));
        pos += len;
      }
      send_chunks(st, who, chunks);
      return;
    }
    case 2: {
      if (who.node_id >= kNodes) return;
      const FakeNode& node = su.honest(who.node_id);
      const int64_t round = st.published_round() + 1;
      std::string bytes = honest_upload(su, node, st, round);
      for (size_t pos = 0; pos + 5 <= n; pos += 5) {
        uint32_t off = 0;
        std::memcpy(&off, p + pos, 4);
        bytes[off % bytes.size()] ^= static_cast<char>(p[pos + 4]);
      }
      upload_bytes(su, st, node.id, round, bytes);  // the node's incarnation, as it joined
      return;
    }
    case 3: {
      pb::WaitRoundRequest req;
      pb::RoundInfo rep;
      if (!parse(&req, p, n)) return;
      req.set_max_wait_ms(0);
      call_wait_round(st, who, req, {}, &rep);
      return;
    }
    case 4: {
      pb::DownloadRequest req;
      if (!parse(&req, p, n)) return;
      int chunks = 0;
      std::string raw;
      call_download(st, who, req, [&](const pb::DownloadChunk& c) {
        // The checksum is of the raw bytes, also when the request let the chunk travel coded.
        const std::string_view bytes =
            unpack_chunk(c.encoding(), c.data(), kChunkBytes, &raw, "a download chunk");
        invariant(c.checksum() == chunk_checksum(bytes), "a download chunk's digest is wrong");
        if (++chunks == 64) sync_fail(SyncErrc::Aborted, "the fuzzed node stops reading");
      });
      return;
    }
    case 5: {
      pb::LeaveRequest req;
      if (parse(&req, p, n)) call_leave(st, who, req);
      return;
    }
    case 6: {
      pb::HeartbeatRequest req;
      pb::HeartbeatReply rep;
      if (parse(&req, p, n)) call_heartbeat(st, who, req, &rep);
      return;
    }
    case 7: {
      pb::StatusReply rep;
      call_status(st, &rep);
      return;
    }
    default:
      return;  // 8: only the tick below
  }
}

void run_round_rpc(const Setup& su, const uint8_t* data, size_t size) {
  TempDir dir;
  RoundState st(su.cfg, ServeOptions{dir.path});
  for (int i = 0; i < kNodes; ++i) st.join(su.honest(i).join_info());
  for (size_t pos = 0; pos + 4 <= size;) {
    const int op = data[pos] % 9;
    NodeId who;
    who.node_id = data[pos + 1] % (kNodes + 1);
    uint16_t n = 0;
    std::memcpy(&n, data + pos + 2, 2);
    pos += 4;
    n = static_cast<uint16_t>(std::min<size_t>(n, size - pos));
    refusable([&] { one_call(su, st, op, who, data + pos, n); });
    pos += n;
    try {
      st.tick();
    } catch (const std::exception& e) {
      invariant(false, std::string("tick() threw: ") + e.what());
    }
    check_serialisable(st);
  }
  // The honest nodes take part again and publish the next round; its model downloads intact.
  const int64_t next = st.published_round() + 1;
  for (int i = 0; i < kNodes; ++i) {
    const FakeNode& node = su.honest(i);
    st.join(node.join_info());
    refusable([&] { upload_bytes(su, st, node.id, next, honest_upload(su, node, st, next)); });
  }
  invariant(st.published_round() == next,
            "the honest nodes' round " + std::to_string(next) + " did not publish (published: " +
                std::to_string(st.published_round()) + ")");
  FakeNode fresh(su.cfg, 0, 99);
  fresh.download(st, next, Selection::All);
  invariant(fresh.reg->weights_sha256() == st.status().model_sha256,
            "a full download does not reproduce the published digest");
  st.close();
}

}  // namespace

void fuzz_round_rpc(const uint8_t* data, size_t size) {
  run_round_rpc(setup_of(Compression::None), data, size);
}

void fuzz_round_rpc_int8(const uint8_t* data, size_t size) {
  run_round_rpc(setup_of(Compression::Int8), data, size);
}

}  // namespace spes::fuzz
#endif
