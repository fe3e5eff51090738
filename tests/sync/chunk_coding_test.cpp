// Chunk coding on the wire (src/spes/sync/wire/chunk_coding.h): pack/unpack against libzstd's
// own one-shot API (frames this code makes decode there, and the reverse), data that does not
// shrink going raw, and hostile frames (unknown encoding, garbage, truncated, no content size,
// a size above the limit) refused with the right code; at the server's staging, a coded upload
// stages the bytes a raw one does, a damaged frame is transport damage (the node stays in the
// round and resumes) and a protocol violation puts the node out of the round; and end to end,
// against a real `spes serve` on loopback, a node with coding on and one with it off finish a
// round on the published digest, while the coded transfers cross the wire in fewer bytes
// (node records and rounds.jsonl count both sizes).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <zstd.h>

#include <chrono>
#include <filesystem>
#include <random>
#include <thread>

#include "spes/io/files.h"
#include "spes/io/run_layout.h"
#include "spes/io/safetensors.h"
#include "spes/sync/node/client.h"
#include "spes/sync/wire/checksum.h"
#include "spes/sync/wire/chunk_coding.h"
#include "sync/serve_fixture.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;
using ::testing::HasSubstr;

namespace {

// Bytes shaped like an int8 delta: Gaussian values with a standard deviation of 40 levels.
std::string int8_like(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> g(0.0, 40.0);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(std::clamp(std::lround(g(rng)), -127L, 127L));
  return s;
}

std::string random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}

std::string unpacked(uint32_t encoding, const std::string& data, uint64_t max = kMaxChunkBytes) {
  std::string scratch;
  return std::string(unpack_chunk(encoding, data, max, &scratch, "test chunk"));
}

constexpr uint32_t kZstd = static_cast<uint32_t>(ChunkEncoding::Zstd);
constexpr uint32_t kRaw = static_cast<uint32_t>(ChunkEncoding::Raw);

}  // namespace

TEST(ChunkCoding, AnInt8LikeChunkShrinksAndDecodesWithLibzstdItself) {
  const std::string raw = int8_like(kChunkBytes, 1);
  std::string packed;
  ASSERT_EQ(pack_chunk(raw, &packed), ChunkEncoding::Zstd);
  // Order-0 entropy of these values is about 7.5 bits: a coder that works saves several %.
  EXPECT_LT(packed.size(), raw.size() * 97 / 100);
  EXPECT_EQ(unpacked(kZstd, packed), raw);
  // libzstd's one-shot decoder reads the frame, and its content size is recorded.
  EXPECT_EQ(ZSTD_getFrameContentSize(packed.data(), packed.size()), raw.size());
  std::string other(raw.size(), '\0');
  EXPECT_EQ(ZSTD_decompress(other.data(), other.size(), packed.data(), packed.size()),
            raw.size());
  EXPECT_EQ(other, raw);
  // A frame from libzstd's one-shot encoder (another level) decodes here.
  std::string frame(ZSTD_compressBound(raw.size()), '\0');
  frame.resize(ZSTD_compress(frame.data(), frame.size(), raw.data(), raw.size(), 9));
  EXPECT_EQ(unpacked(kZstd, frame), raw);
}

TEST(ChunkCoding, DataThatDoesNotShrinkGoesRaw) {
  std::string packed = "left over";
  EXPECT_EQ(pack_chunk(random_bytes(1 << 20, 2), &packed), ChunkEncoding::Raw);
  EXPECT_TRUE(packed.empty());
  EXPECT_EQ(pack_chunk("", &packed), ChunkEncoding::Raw);
  EXPECT_EQ(pack_chunk("a", &packed), ChunkEncoding::Raw);  // a frame is never 0 bytes
  const std::string raw = random_bytes(1000, 3);
  EXPECT_EQ(unpacked(kRaw, raw), raw);
  // Very compressible data: far smaller.
  ASSERT_EQ(pack_chunk(std::string(1 << 20, 'x'), &packed), ChunkEncoding::Zstd);
  EXPECT_LT(packed.size(), 1000u);
}

TEST(ChunkCoding, HostileFramesAreRefusedWithTheRightCode) {
  const std::string raw = int8_like(100000, 4);
  std::string packed;
  ASSERT_EQ(pack_chunk(raw, &packed), ChunkEncoding::Zstd);
  EXPECT_EQ(code_of([&] { unpacked(7, packed); }), SyncErrc::InvalidArgument);
  EXPECT_THAT(error_of([&] { unpacked(7, packed); }), HasSubstr("unknown chunk encoding 7"));
  EXPECT_EQ(code_of([&] { unpacked(kZstd, "not a zstd frame at all"); }), SyncErrc::DataLoss);
  EXPECT_EQ(code_of([&] { unpacked(kZstd, ""); }), SyncErrc::DataLoss);
  EXPECT_EQ(code_of([&] { unpacked(kZstd, packed.substr(0, packed.size() / 2)); }),
            SyncErrc::DataLoss);
  // A frame that claims more than the receiver allows is refused before anything is allocated.
  EXPECT_EQ(code_of([&] { unpacked(kZstd, packed, raw.size() - 1); }),
            SyncErrc::ResourceExhausted);
  std::string big;
  ASSERT_EQ(pack_chunk(std::string(kMaxChunkBytes + 1, 'x'), &big), ChunkEncoding::Zstd);
  EXPECT_THAT(error_of([&] { unpacked(kZstd, big); }), HasSubstr("claims 4194305 bytes"));
  // A frame without its content size (streaming encoders may leave it out).
  ZSTD_CCtx* c = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(c, ZSTD_c_contentSizeFlag, 0);
  std::string sizeless(ZSTD_compressBound(raw.size()), '\0');
  sizeless.resize(ZSTD_compress2(c, sizeless.data(), sizeless.size(), raw.data(), raw.size()));
  ZSTD_freeCCtx(c);
  EXPECT_EQ(code_of([&] { unpacked(kZstd, sizeless); }), SyncErrc::DataLoss);
  // Damage inside the frame: an error, or other bytes (which the chunk checksum then refuses).
  std::string damaged = packed;
  damaged[damaged.size() / 2] ^= 0x5a;
  std::string out;
  const SyncErrc code = code_of([&] { out = unpacked(kZstd, damaged); });
  if (code == SyncErrc::Internal) {  // code_of: nothing thrown
    EXPECT_NE(chunk_checksum(out), chunk_checksum(raw));
  } else {
    EXPECT_EQ(code, SyncErrc::DataLoss);
  }
}

TEST(ChunkCoding, TheServerStagesCodedUploadsAndTellsDamageFromViolations) {
  TempDir tmp;
  const Config cfg = tiny_config({"spes_config.round_timeout=60"});
  RoundState st(cfg, {tmp.path});
  FakeNode a(cfg, 0, 1), b(cfg, 1, 2);
  st.join(a.join_info());
  st.join(b.join_info());
  const auto ua = upload_of(a, 1, trained(a, st, 0.001));
  std::string bytes;
  ua.read(0, ua.total_bytes(), &bytes);
  const uint64_t total = bytes.size(), piece = 1000;
  auto send = [&](UploadSession& s, uint64_t from, uint64_t upto, int64_t damage_at = -1) {
    for (uint64_t off = from; off < upto; off += piece) {
      std::string raw = bytes.substr(off, std::min(piece, upto - off)), packed;
      const ChunkEncoding enc = pack_chunk(raw, &packed);
      std::string data = enc == ChunkEncoding::Raw ? raw : packed;
      if (static_cast<int64_t>(off) == damage_at) {
        ASSERT_EQ(enc, ChunkEncoding::Zstd) << "the chunk at " << off << " should shrink";
        data = data.substr(0, data.size() / 2);
      }
      s.chunk(off, data, chunk_checksum(raw), static_cast<uint32_t>(enc));
    }
  };
  // A damaged frame in the third chunk: transport damage, the two before it are kept.
  {
    auto s = st.begin_upload(a.id, 1, 10, total);
    EXPECT_EQ(code_of([&] { send(*s, 0, total, 2 * piece); }), SyncErrc::DataLoss);
  }
  EXPECT_EQ(st.upload_resume_offset(a.id, 1, 10, total), 2 * piece);
  {
    auto s = st.begin_upload(a.id, 1, 10, total, 2 * piece);
    send(*s, 2 * piece, total);
    const UploadResult r = s->finish(chunk_checksum(bytes));
    EXPECT_TRUE(r.accepted);
    EXPECT_EQ(r.bytes, total);
  }
  // The staged file holds exactly the raw stream.
  EXPECT_EQ(file_read(run_layout::staged_upload(tmp.path, 1, 0)), bytes);
  // Node b breaks the protocol (an encoding nobody knows): out of the round.
  const auto ub = upload_of(b, 1, trained(b, st, -0.002));
  std::string bb;
  ub.read(0, ub.total_bytes(), &bb);
  {
    auto s = st.begin_upload(b.id, 1, 10, bb.size());
    const std::string head = bb.substr(0, 100);
    EXPECT_EQ(code_of([&] { s->chunk(0, head, chunk_checksum(head), 9); }),
              SyncErrc::InvalidArgument);
  }
  // The round then publishes at once with node 0 alone (node 1 is out, not awaited).
  const RoundStatus r = st.wait_round(a.id, 1, 10);
  ASSERT_TRUE(r.published);
  EXPECT_EQ(r.nodes, std::vector<int64_t>{0});
}

TEST(ChunkCoding, CodedAndRawNodesFinishARoundOnThePublishedDigestWithFewerBytesCoded) {
  ServeFixture f;
  ASSERT_FALSE(f.address.empty()) << f.srv->log();
  FakeNode a(f.cfg, 0, 1), b(f.cfg, 1, 2);
  a.id.auth_token = ServeFixture::token(0);
  b.id.auth_token = ServeFixture::token(1);
  SyncClient ca(f.address, a.id), cb(f.address, b.id);
  ca.set_chunk_coding(true);
  ca.join(a.join_info());
  cb.join(b.join_info());
  auto fetch = [](SyncClient& c, FakeNode& n, int64_t round, Selection sel) {
    std::string bytes;
    c.download(round, sel, [](uint64_t) {}, [&](const char* p, size_t k) { bytes.append(p, k); });
    for (const auto& [name, t] : safetensors_parse(bytes)) {
      torch::NoGradGuard ng;
      n.reg->find(name)->tensor.copy_(t);
    }
    return bytes;
  };
  // The initial model: the same bytes either way, fewer of them on the coded wire.
  const std::string all_a = fetch(ca, a, 0, Selection::All);
  const std::string all_b = fetch(cb, b, 0, Selection::All);
  EXPECT_EQ(all_a, all_b);
  EXPECT_LT(ca.download_wire_bytes(), all_a.size());
  EXPECT_EQ(cb.download_wire_bytes(), all_b.size());
  // Round 1.
  {
    torch::NoGradGuard ng;
    for (const auto& e : a.reg->entries())
      if (e.trainable) e.tensor.add_(0.001);
    for (const auto& e : b.reg->entries())
      if (e.trainable) e.tensor.sub_(0.002);
  }
  const std::string shared = "model.layers.0.self_attn.q_proj.weight";
  const torch::Tensor want = (a.reg->find(shared)->tensor.detach().clone() +
                              b.reg->find(shared)->tensor.detach()) / 2;
  const UploadResult ua = ca.upload(1, 10, a.upload(1));
  const UploadResult ub = cb.upload(1, 10, b.upload(1));
  ASSERT_TRUE(ua.accepted && ub.accepted);
  EXPECT_LT(ua.bytes_sent, ua.bytes);
  EXPECT_EQ(ub.bytes_sent, ub.bytes);
  RoundStatus st;
  for (int i = 0; i < 100 && !st.published; ++i) st = ca.wait_round(1, 2000);
  ASSERT_TRUE(st.published) << f.srv->log();
  const uint64_t wire_a = ca.download_wire_bytes();
  const std::string for_a = fetch(ca, a, 1, Selection::ForNode);
  fetch(cb, b, 1, Selection::ForNode);
  EXPECT_LT(ca.download_wire_bytes() - wire_a, for_a.size());
  EXPECT_EQ(a.reg->weights_sha256(), st.model_sha256);
  EXPECT_EQ(b.reg->weights_sha256(), st.model_sha256);
  EXPECT_TRUE(torch::allclose(a.reg->find(shared)->tensor.detach(), want, 0, 1e-7));
  // The server counts both sizes (its line is written once both downloads are complete).
  std::vector<nlohmann::json> lines;
  for (int i = 0; i < 100 && lines.empty(); ++i) {
    if (std::filesystem::exists(f.tmp.path + "/srv/rounds.jsonl"))
      lines = read_jsonl(f.tmp.path + "/srv/rounds.jsonl");
    if (lines.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_EQ(lines.size(), 1u) << f.srv->log();
  const auto& l = lines[0];
  EXPECT_LT(l["bytes_in_wire_per_node"][0].get<uint64_t>(),
            l["bytes_in_per_node"][0].get<uint64_t>()) << l.dump();
  EXPECT_EQ(l["bytes_in_wire_per_node"][1], l["bytes_in_per_node"][1]) << l.dump();
  EXPECT_LT(l["bytes_out_wire_per_node"][0].get<uint64_t>(),
            l["bytes_out_per_node"][0].get<uint64_t>()) << l.dump();
  EXPECT_EQ(l["bytes_out_wire_per_node"][1], l["bytes_out_per_node"][1]) << l.dump();
  ca.leave(10, "test done");
  cb.leave(10, "test done");
}
