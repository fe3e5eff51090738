// The top-k sparse delta codec (src/spes/sync/wire/topk_kernels.h, topk_codec.h) and its error
// feedback (src/spes/sync/round/topk_feedback.h): selection, quantisation and the rebuild
// prev + deq bit for bit against numpy (tests/sync/topk_reference.py) at 2, 3 and 4 bits; the
// three index codings decode to the same entries and the encoder picks the smallest; with
// decay 1 what was sent plus what is held equals the sum of the changes over many rounds;
// every malformed payload (built here by an independent writer) refused with its reason; the
// settings' checks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

#include "python_reference.h"
#include "spes/io/config.h"
#include "spes/io/files.h"
#include "spes/sync/round/topk_feedback.h"
#include "spes/sync/server/round_state.h"
#include "spes/sync/wire/chunk_coding.h"
#include "spes/sync/wire/topk_codec.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;
using ::testing::HasSubstr;

namespace {

void write_raw(const std::string& path, const torch::Tensor& t) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.numel() * 4));
}

std::string bytes_of(const torch::Tensor& t) {
  return std::string(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()) * 4);
}

// Deltas with the edge cases: 3 full chunks and a short one (777 values). Chunk 0: 300 exact
// ties of magnitude (+-0.05, larger than the rest) of which the first 82 positions are sent;
// chunk 1 all zero; chunk 2 one huge value among tiny ones, which round to level 0 and are not
// sent; chunk 3 fewer nonzero values than k.
torch::Tensor edge_case_deltas() {
  const int64_t C = kTopkChunk;
  torch::manual_seed(11);
  torch::Tensor d = torch::randn({3 * C + 777}) * 0.01;
  d.slice(0, 0, C).clamp_(-0.04, 0.04);
  for (int64_t k = 0; k < 300; ++k) d[100 + 7 * k] = (k % 2 ? -0.05f : 0.05f);
  d.slice(0, C, 2 * C).zero_();
  d.slice(0, 2 * C, 3 * C).mul_(1e-3);
  d[2 * C + 5] = 3.0e4f;
  d.slice(0, 3 * C, 3 * C + 777).zero_();
  d[3 * C + 3] = -0.25f;
  d[3 * C + 500] = 0.125f;
  return d;
}

TopkSparse decode_ok(const std::string& payload, int64_t n, const TopkParams& p) {
  TopkSparse s;
  const std::string why = topk_decode(reinterpret_cast<const uint8_t*>(payload.data()),
                                      static_cast<int64_t>(payload.size()), n, p, &s);
  EXPECT_EQ(why, "");
  return s;
}

std::string refusal(const std::string& payload, int64_t n, const TopkParams& p) {
  try {
    topk_decode_checked(payload, n, p, "layers.0.w", "upload of node 3");
  } catch (const SyncError& e) {
    EXPECT_EQ(e.code(), SyncErrc::InvalidArgument);
    return e.what();
  }
  return "";
}

// An independent writer of the payload layout with positions coding, so that malformed
// payloads can be built: per chunk (count, scale, positions, codes).
struct Chunk {
  uint16_t count;
  float scale;
  std::vector<uint32_t> pos;
  std::vector<uint32_t> code;
};
std::string handmade(const std::vector<Chunk>& chunks, int64_t n, int bits, int pos_bits,
                     uint32_t header_chunks = 0) {
  std::string o;
  o.push_back(1);
  o.push_back(static_cast<char>(bits));
  o.push_back(1);  // positions
  o.push_back(0);
  const uint32_t nc = header_chunks ? header_chunks : static_cast<uint32_t>(chunks.size());
  o.append(reinterpret_cast<const char*>(&nc), 4);
  for (const auto& c : chunks) o.append(reinterpret_cast<const char*>(&c.count), 2);
  for (const auto& c : chunks) o.append(reinterpret_cast<const char*>(&c.scale), 4);
  std::vector<bool> bitstream;
  for (const auto& c : chunks)
    for (uint32_t p : c.pos)
      for (int b = 0; b < pos_bits; ++b) bitstream.push_back((p >> b) & 1);
  for (const auto& c : chunks)
    for (uint32_t v : c.code)
      for (int b = 0; b < bits; ++b) bitstream.push_back((v >> b) & 1);
  for (size_t k = 0; k < bitstream.size(); k += 8) {
    uint8_t byte = 0;
    for (size_t j = 0; j < 8 && k + j < bitstream.size(); ++j) byte |= bitstream[k + j] << j;
    o.push_back(static_cast<char>(byte));
  }
  (void)n;
  return o;
}

}  // namespace

TEST(TopkCodec, SelectionQuantisationAndRebuildMatchNumpyBitForBit) {
  TempDir dir;
  const torch::Tensor d = edge_case_deltas();
  const torch::Tensor prev = torch::randn({d.numel()});
  write_raw(dir.path + "/d.f32", d);
  write_raw(dir.path + "/prev.f32", prev);
  for (int bits : {2, 3, 4}) {
    SCOPED_TRACE(bits);
    const TopkParams p{0.02, bits};
    test::run_python_reference("sync/topk_reference.py",
                               {dir.path + "/d.f32", dir.path + "/prev.f32",
                                std::to_string(kTopkChunk), "0.02", std::to_string(bits),
                                dir.path + "/ref"});
    const TopkEncoded e = topk_encode_tensor(d, p, "t");
    EXPECT_EQ(file_read(dir.path + "/ref.deq.f32"), bytes_of(e.deq));
    const TopkSparse s = topk_decode_checked(e.payload, d.numel(), p, "t", "test");
    const torch::Tensor rebuilt = topk_rebuild_tensor(prev, s);
    EXPECT_EQ(file_read(dir.path + "/ref.rebuilt.f32"), bytes_of(rebuilt));
    // The decoder's values are the encoder's deq exactly (deq alone: prev = 0 everywhere).
    EXPECT_TRUE(torch::equal(topk_rebuild_tensor(torch::zeros_like(d), s), e.deq));
    // The edge cases, spelled out: k per chunk, the ties of chunk 0 at their lowest positions,
    // nothing from the zero chunk, only the huge value of chunk 2 (exactly: 30000 is a level),
    // the short chunk's two values both sent.
    const int64_t C = kTopkChunk, k = topk_chunk_k(0.02, C);
    EXPECT_EQ(k, 82);
    for (int64_t j = 0; j < 82; ++j) EXPECT_NE(e.deq[100 + 7 * j].item<float>(), 0.0f) << j;
    EXPECT_EQ((e.deq.slice(0, 0, C) != 0).sum().item<int64_t>(), k);
    EXPECT_EQ((e.deq.slice(0, C, 2 * C) != 0).sum().item<int64_t>(), 0);
    EXPECT_EQ(e.deq[2 * C + 5].item<float>(), 3.0e4f);
    EXPECT_EQ((e.deq.slice(0, 2 * C, 3 * C) != 0).sum().item<int64_t>(), 1);
    EXPECT_EQ((e.deq.slice(0, 3 * C, 3 * C + 777) != 0).sum().item<int64_t>(), 2);
    EXPECT_EQ(static_cast<int64_t>(s.index.size()), k + 3);
  }
}

TEST(TopkCodec, IndexCodingsDecodeAlikeAndTheSmallestIsChosen) {
  torch::manual_seed(3);
  const torch::Tensor d = torch::randn({5 * kTopkChunk + 1000});
  for (double density : {1.0 / 64, 0.02, 0.3}) {
    SCOPED_TRACE(density);
    const TopkParams p{density, 2};
    const TopkEncoded pick = topk_encode_tensor(d, p, "t");
    const TopkSparse ref = decode_ok(pick.payload, d.numel(), p);
    size_t smallest = std::numeric_limits<size_t>::max();
    for (int coding = 0; coding < 3; ++coding) {
      const TopkEncoded e = topk_encode_tensor(d, p, "t", coding);
      const TopkSparse s = decode_ok(e.payload, d.numel(), p);
      EXPECT_EQ(s.index, ref.index) << topk_index_coding_name(TopkIndexCoding(coding));
      EXPECT_EQ(s.value, ref.value);
      smallest = std::min(smallest, e.payload.size());
      std::string z;
      pack_chunk(e.payload, &z);
      std::printf("density %.4f %-9s: %zu bytes (%.3f bits/value), zstd-1 %zu bytes\n", density,
                  topk_index_coding_name(TopkIndexCoding(coding)), e.payload.size(),
                  8.0 * e.payload.size() / d.numel(), z.empty() ? e.payload.size() : z.size());
    }
    EXPECT_EQ(pick.payload.size(), smallest);
    // The transfer formula's estimate (spes compare) against the measured size.
    const double expected = static_cast<double>(topk_expected_bytes(d.numel(), p));
    EXPECT_NEAR(static_cast<double>(smallest) / expected, 1.0, 0.03) << expected;
  }
  // At SparseLoCo's density Rice-coded gaps beat a bitmap (1 bit per value) by far.
  const TopkParams p{1.0 / 64, 2};
  EXPECT_EQ(topk_encode_tensor(d, p, "t").payload[2], char(TopkIndexCoding::Rice));
  // A short tensor (a norm weight of a real model) whose cheapest coding is not Rice carries
  // Rice parameter 0 and decodes (the encoder once kept the best Rice parameter there, which
  // the decoder refuses: found by the first real top-k rounds).
  for (int64_t n : {4, 16, 64, 300}) {
    const torch::Tensor small = torch::randn({n});
    const TopkEncoded e = topk_encode_tensor(small, p, "t");
    if (e.payload[2] != char(TopkIndexCoding::Rice)) EXPECT_EQ(e.payload[3], 0) << n;
    decode_ok(e.payload, n, p);
  }
}

TEST(TopkFeedback, WithDecayOneSentPlusHeldEqualsTheChanges) {
  torch::manual_seed(5);
  const std::vector<int64_t> shape{3, 4096 + 300};
  TopkFeedback fb({0.02, 2}, 1.0);
  fb.reset(1);
  torch::Tensor changes = torch::zeros(shape, torch::kDouble);
  torch::Tensor sent = torch::zeros(shape, torch::kDouble);
  for (int round = 0; round < 60; ++round) {
    const torch::Tensor c = torch::randn(shape) * 1e-3 * (1 + round % 3);
    const torch::Tensor before = fb.held(0).defined() ? fb.held(0).clone() : torch::zeros(shape);
    const TopkEncoded e = fb.encode(0, c, "t");
    // This round exactly: what is held now is (held before + change) - deq, in fp32.
    EXPECT_TRUE(torch::equal(fb.held(0), (before + c) - e.deq));
    changes += c.to(torch::kDouble);
    sent += e.deq.to(torch::kDouble);
  }
  const torch::Tensor total = sent + fb.held(0).to(torch::kDouble);
  EXPECT_LT((total - changes).abs().max().item<double>(), 1e-5);
  EXPECT_GT(fb.held_sq(), 0.0);
  EXPECT_GT(sent.abs().sum().item<double>(), 0.0);
}

TEST(TopkFeedback, DecayScalesWhatIsHeldAndNonFiniteLeavesItAsItWas) {
  torch::manual_seed(6);
  TopkFeedback fb({1.0 / 64, 3}, 0.9);
  fb.reset(2);
  const torch::Tensor c1 = torch::randn({5000});
  fb.encode(1, c1, "t");
  const torch::Tensor held = fb.held(1).clone();
  const torch::Tensor c2 = torch::randn({5000});
  const TopkEncoded e = fb.encode(1, c2, "t");
  EXPECT_TRUE(torch::equal(fb.held(1), (c2 + held * 0.9) - e.deq));
  const torch::Tensor kept = fb.held(1).clone();
  torch::Tensor bad = torch::randn({5000});
  bad[4321] = std::numeric_limits<float>::quiet_NaN();
  try {
    fb.encode(1, bad, "layers.0.attn");
    ADD_FAILURE() << "a NaN change was encoded";
  } catch (const SyncError& err) {
    EXPECT_THAT(err.what(), HasSubstr("tensor 'layers.0.attn'"));
    EXPECT_THAT(err.what(), HasSubstr("element 4321"));
  }
  EXPECT_TRUE(torch::equal(fb.held(1), kept));
  EXPECT_FALSE(fb.held(0).defined());
}

TEST(TopkCodec, EveryMalformedPayloadIsRefusedWithItsReason) {
  const int64_t n = kTopkChunk + 100;  // two chunks: 4096 and 100 values
  const TopkParams p{0.02, 2};         // k = 82 and 2
  const int pb = 12;                   // position bits of a 4096 chunk (7 for 100; see below)
  auto good = [&] {
    return std::vector<Chunk>{{2, 0.5f, {3, 4000}, {0, 3}}, {0, 0.0f, {}, {}}};
  };
  // The handmade writer uses one position width; a second chunk with no entries needs none.
  ASSERT_EQ(refusal(handmade(good(), n, 2, pb), n, p), "");
  {
    const TopkSparse s = topk_decode_checked(handmade(good(), n, 2, pb), n, p, "t", "o");
    EXPECT_EQ(s.index, (std::vector<int64_t>{3, 4000}));
    EXPECT_EQ(s.value, (std::vector<float>{0.5f, -1.0f}));
  }
  auto with = [&](auto change) {
    auto c = good();
    change(c);
    return refusal(handmade(c, n, 2, pb), n, p);
  };
  // Out of range: 12 bits cannot name a position past a 4096-value chunk, but 7 bits can past
  // the short chunk's 100.
  {
    std::vector<Chunk> c{{0, 0.0f, {}, {}}, {1, 0.5f, {120}, {0}}};
    EXPECT_THAT(refusal(handmade(c, n, 2, 7), n, p),
                HasSubstr("chunk 1: index 120 is out of range (the chunk has 100 values)"));
  }
  EXPECT_THAT(with([](auto& c) { c[0].pos = {40, 40}; }),
              HasSubstr("chunk 0: position 40 is repeated"));
  EXPECT_THAT(with([](auto& c) { c[0].pos = {40, 7}; }),
              HasSubstr("chunk 0: positions are not ascending (7 after 40)"));
  EXPECT_THAT(with([](auto& c) { c[0].scale = std::numeric_limits<float>::quiet_NaN(); }),
              HasSubstr("chunk 0: its scale is not finite"));
  EXPECT_THAT(with([](auto& c) { c[0].scale = std::numeric_limits<float>::infinity(); }),
              HasSubstr("chunk 0: its scale is not finite"));
  EXPECT_THAT(with([](auto& c) { c[0].scale = -1.0f; }), HasSubstr("is not in (0, FLT_MAX/8]"));
  EXPECT_THAT(with([](auto& c) { c[1].scale = 2.0f; }),
              HasSubstr("chunk 1: carries no entries but a scale"));
  // Counts that disagree with what follows: one entry more than its bit stream holds.
  EXPECT_THAT(with([](auto& c) { c[0].count = 3; }),
              HasSubstr("the payload ends before its last index or value"));
  // ... or fewer: bytes are left over.
  EXPECT_THAT(with([](auto& c) { c[0].count = 1; }), HasSubstr("after its last value"));
  // More entries than the density allows (the short chunk allows 2).
  {
    std::vector<Chunk> c = good();
    c[0] = {0, 0.0f, {}, {}};
    c[1] = {3, 0.5f, {1, 2, 3}, {0, 0, 0}};
    EXPECT_THAT(refusal(handmade(c, n, 2, 7), n, p),
                HasSubstr("chunk 1 carries 3 entries; topk_density 0.020000 allows at most 2 of "
                          "its 100 values"));
    std::vector<Chunk> many{{83, 0.5f, {}, {}}, {0, 0.0f, {}, {}}};
    for (uint32_t i = 0; i < 83; ++i) many[0].pos.push_back(i), many[0].code.push_back(0);
    EXPECT_THAT(refusal(handmade(many, n, 2, pb), n, p),
                HasSubstr("chunk 0 carries 83 entries; topk_density 0.020000 allows at most 82"));
  }
  // The header: chunk count, format, bits, coding, sizes.
  EXPECT_THAT(refusal(handmade(good(), n, 2, pb, 3), n, p),
              HasSubstr("the header counts 3 chunks; a tensor of 4196 values has 2"));
  std::string s = handmade(good(), n, 2, pb);
  EXPECT_THAT(refusal(s.substr(0, 5), n, p), HasSubstr("fewer than its 8-byte header"));
  EXPECT_THAT(refusal(s.substr(0, 15), n, p), HasSubstr("fewer than the 20 its header"));
  EXPECT_THAT(refusal(s + std::string(1, '\0'), n, p), HasSubstr("after its last value"));
  EXPECT_THAT(refusal(handmade(good(), n, 3, pb), n, p),
              HasSubstr("values of 3 bits where the run uses topk_bits 2"));
  std::string t = s;
  t[0] = 9;
  EXPECT_THAT(refusal(t, n, p), HasSubstr("unknown payload format 9"));
  t = s;
  t[2] = 7;
  EXPECT_THAT(refusal(t, n, p), HasSubstr("unknown index coding 7"));
  t = s;
  t[3] = 4;
  EXPECT_THAT(refusal(t, n, p), HasSubstr("Rice parameter 4 is not valid for index coding "
                                          "positions"));
  // The message names the sender and the tensor.
  EXPECT_THAT(refusal(t, n, p), HasSubstr("upload of node 3: tensor 'layers.0.w': its topk "
                                          "delta is refused"));
  // A bitmap whose population disagrees with its count, and a Rice gap past the chunk: taken
  // from valid payloads of each coding, one bit changed.
  torch::manual_seed(9);
  const torch::Tensor d = torch::randn({n});
  std::string bm = topk_encode_tensor(d, p, "t", int(TopkIndexCoding::Bitmap)).payload;
  const size_t bits_at = kTopkFixedHeader + 2 * 6;
  bm[bits_at] = static_cast<char>(bm[bits_at] ^ 1);
  EXPECT_THAT(refusal(bm, n, p), HasSubstr("chunk 0: its bitmap holds"));
  std::string rice = topk_encode_tensor(d, p, "t", int(TopkIndexCoding::Rice)).payload;
  // 4096 >> r ones in a row are a gap past the chunk (r: the payload's Rice parameter).
  const size_t ones = (size_t{4096} >> rice[3]) / 8 + 2;
  ASSERT_LT(bits_at + ones, rice.size());
  for (size_t k = bits_at; k < bits_at + ones; ++k) rice[k] = char(0xFF);
  EXPECT_THAT(refusal(rice, n, p), HasSubstr("an index gap runs past the chunk"));
  // Every truncation of a valid payload is refused, never read past its end.
  const std::string full = topk_encode_tensor(d, p, "t").payload;
  for (size_t len = 0; len < full.size(); ++len)
    EXPECT_NE(refusal(full.substr(0, len), n, p), "") << len;
}

TEST(TopkCodec, SettingsAreCheckedAndRobustAggregationRefused) {
  auto config_error = [](const std::string& yaml) -> std::string {
    try {
      config_parse("spes_config:\n" + yaml, {}, "t.yaml");
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  const Config c = config_parse("", {}, "t.yaml");
  EXPECT_DOUBLE_EQ(c.spes_config.transfer.topk_density, 1.0 / 64);
  EXPECT_EQ(c.spes_config.transfer.topk_bits, 2);
  EXPECT_DOUBLE_EQ(c.spes_config.transfer.topk_decay, 1.0);
  EXPECT_THAT(config_error("  topk_density: 0\n"), HasSubstr("topk_density must be in (0, 0.5]"));
  EXPECT_THAT(config_error("  topk_bits: 8\n"), HasSubstr("topk_bits must be 2, 3 or 4"));
  EXPECT_THAT(config_error("  topk_decay: 1.5\n"), HasSubstr("topk_decay must be in (0, 1]"));
  EXPECT_DOUBLE_EQ(c.spes_config.transfer.topk_down_density, 0);
  EXPECT_THAT(config_error("  topk_down_density: 0.01\n"),
              HasSubstr("topk_down_density must be 0 (the same as topk_density) or in "
                        "[topk_density=0.015625, 0.5]"));
  EXPECT_THAT(config_error("  topk_down_density: 0.75\n"), HasSubstr("found 0.75"));
  EXPECT_EQ(config_error("  topk_down_density: 0.0625\n"), "");
  EXPECT_THAT(config_error("  compression: topk\n  aggregation: median\n"),
              HasSubstr("spes_config.aggregation=median with compression: topk is refused"));
  EXPECT_THAT(config_error("  compression: topk\n  aggregation: trimmed_mean\n"),
              HasSubstr("a per-position median or trimmed mean is zero almost everywhere"));
  // The setting is taken (rounds carry it: tests/sync/topk_round_test.cpp).
  EXPECT_EQ(config_error("  compression: topk\n"), "");
}
