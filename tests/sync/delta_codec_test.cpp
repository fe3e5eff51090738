// The compressed-delta codec (src/spes/sync/wire/delta_codec.h, delta_kernels.h) against an
// independent computation: int8 quantisation, scales and the rebuild P_prev + deq(q) bit for
// bit against numpy, bf16 against PyTorch's rounding; edge cases (an all-zero block, one huge
// value in a block, a tensor that is not a multiple of the block, exact ties, NaN/Inf refused
// on the node side); and error feedback on a node's DeltaUpload over many rounds: what was
// sent tracks what was trained within one quantum, and without feedback it drifts.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>

#include "python_reference.h"
#include "spes/io/files.h"
#include "spes/sync/round/delta_upload.h"
#include "spes/sync/wire/delta_codec.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;
using ::testing::HasSubstr;

namespace {

void write_raw(const std::string& path, const void* p, size_t n) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(p), static_cast<std::streamsize>(n));
}

std::string read_raw(const std::string& path) { return file_read(path); }

// Deltas with every edge case in one tensor of 4 full blocks and a partial one.
torch::Tensor edge_case_deltas() {
  const int64_t B = kDeltaBlock;
  torch::manual_seed(7);
  torch::Tensor d = torch::randn({4 * B + 77}) * 0.01;
  d.slice(0, B, 2 * B).zero_();                  // block 1: all zero (scale 0)
  d.slice(0, 2 * B, 3 * B).mul_(1e-3);           // block 2: tiny values and one huge value
  d[2 * B + 100] = 3.0e4;
  torch::Tensor b3 = d.slice(0, 3 * B, 4 * B);   // block 3: scale exactly 1, ties at .5
  b3.uniform_(-100, 100);
  b3[0] = 127.0;
  b3[1] = 2.5;   // -> 2 (half to even)
  b3[2] = -3.5;  // -> -4
  b3[3] = 0.5;   // -> 0
  d.slice(0, 4 * B).mul_(1e-3);                  // the partial last block
  return d;
}

}  // namespace

TEST(DeltaCodec, Int8AndBf16MatchNumpyAndTorchBitForBit) {
  TempDir dir;
  const torch::Tensor d = edge_case_deltas();
  const torch::Tensor prev = torch::randn({d.numel()});
  write_raw(dir.path + "/d.f32", d.data_ptr(), d.numel() * 4);
  write_raw(dir.path + "/prev.f32", prev.data_ptr(), prev.numel() * 4);
  test::run_python_reference("sync/delta_reference.py", {dir.path + "/d.f32",
                             dir.path + "/prev.f32", std::to_string(kDeltaBlock),
                             dir.path + "/ref"});
  const EncodedDelta q = delta_encode(d, Compression::Int8, "t");
  ASSERT_EQ(q.q.scalar_type(), torch::kInt8);
  ASSERT_EQ(q.scales.numel(), 5);
  EXPECT_EQ(read_raw(dir.path + "/ref.q.i8"),
            std::string(static_cast<const char*>(q.q.data_ptr()), q.q.numel()));
  EXPECT_EQ(read_raw(dir.path + "/ref.scales.f32"),
            std::string(static_cast<const char*>(q.scales.data_ptr()), 5 * 4));
  const torch::Tensor rebuilt = delta_rebuild(prev, q, Compression::Int8);
  EXPECT_EQ(read_raw(dir.path + "/ref.rebuilt.f32"),
            std::string(static_cast<const char*>(rebuilt.data_ptr()), rebuilt.numel() * 4));
  // The edge cases, spelled out.
  const int64_t B = kDeltaBlock;
  EXPECT_EQ(q.scales[1].item<float>(), 0.0f);
  EXPECT_EQ(q.q.slice(0, B, 2 * B).abs().sum().item<int64_t>(), 0);
  EXPECT_EQ(q.scales[2].item<float>(), 3.0e4f / 127.0f);
  EXPECT_EQ(q.q[2 * B + 100].item<int8_t>(), 127);
  EXPECT_EQ(q.q.slice(0, 2 * B, 2 * B + 100).abs().sum().item<int64_t>(), 0);  // drowned
  EXPECT_EQ(q.q[3 * B + 1].item<int8_t>(), 2);
  EXPECT_EQ(q.q[3 * B + 2].item<int8_t>(), -4);
  EXPECT_EQ(q.q[3 * B + 3].item<int8_t>(), 0);
  // Quantisation error at most half a quantum (and exact for the block maxima).
  const torch::Tensor err = (delta_rebuild(torch::Tensor(), q, Compression::Int8) - d).abs();
  for (int64_t b = 0; b < 5; ++b) {
    const float s = q.scales[b].item<float>();
    EXPECT_LE(err.slice(0, b * B, std::min(d.numel(), (b + 1) * B)).max().item<float>(),
              0.5f * s * 1.0001f + 1e-30f) << "block " << b;
  }

  const EncodedDelta h = delta_encode(d, Compression::Bf16, "t");
  ASSERT_EQ(h.q.scalar_type(), torch::kBFloat16);
  EXPECT_FALSE(h.scales.defined());
  EXPECT_EQ(read_raw(dir.path + "/ref.bf16.u16"),
            std::string(static_cast<const char*>(h.q.data_ptr()), h.q.numel() * 2));
  EXPECT_TRUE(torch::equal(h.q, d.to(torch::kBFloat16)));
  const torch::Tensor rebuilt_bf16 = delta_rebuild(prev, h, Compression::Bf16);
  EXPECT_EQ(read_raw(dir.path + "/ref.rebuilt_bf16.f32"),
            std::string(static_cast<const char*>(rebuilt_bf16.data_ptr()),
                        rebuilt_bf16.numel() * 4));
}

TEST(DeltaCodec, PayloadSizesAndNames) {
  EXPECT_EQ(delta_blocks(0), 0);
  EXPECT_EQ(delta_blocks(1), 1);
  EXPECT_EQ(delta_blocks(kDeltaBlock), 1);
  EXPECT_EQ(delta_blocks(kDeltaBlock + 1), 2);
  EXPECT_EQ(delta_payload_bytes(Compression::Int8, 1000), 1000u + 4 * 4);
  EXPECT_EQ(delta_payload_bytes(Compression::Bf16, 1000), 2000u);
  EXPECT_EQ(delta_payload_bytes(Compression::None, 1000), 4000u);
  EXPECT_EQ(delta_scale_name("a.weight"), "a.weight:scale");
  EXPECT_EQ(Choice<Compression>::parse("int8"), Compression::Int8);
  EXPECT_STREQ(compression_name(Compression::Bf16), "bf16");
  EXPECT_THAT(error_of([] { config_parse("", {"spes_config.compression=fp8"}, "t"); }),
              HasSubstr("spes_config.compression must be none, bf16, int8 or topk, found 'fp8'"));
}

TEST(DeltaCodec, NonFiniteDeltaIsRefusedOnTheNodeNamingTheTensor) {
  torch::Tensor d = torch::zeros({300});
  d[290] = std::numeric_limits<float>::quiet_NaN();
  for (Compression c : {Compression::Int8, Compression::Bf16}) {
    const std::string why = error_of([&] { delta_encode(d, c, "model.norm.weight"); });
    EXPECT_THAT(why, HasSubstr("model.norm.weight"));
    EXPECT_THAT(why, HasSubstr("element 290"));
  }
  d[290] = std::numeric_limits<float>::infinity();
  EXPECT_THAT(error_of([&] { delta_encode(d, Compression::Int8, "x"); }), HasSubstr("'x'"));
  d[290] = 3.4e38f;  // finite, but rounds to an infinity in bf16
  EXPECT_THAT(error_of([&] { delta_encode(d, Compression::Bf16, "x"); }), HasSubstr("'x'"));
  EXPECT_NO_THROW(delta_encode(d, Compression::Int8, "x"));
}

TEST(DeltaCodec, StreamDecoderRefusesBadScalesNamingTheTensor) {
  const StreamEntry scale_e{"w:scale", torch::kFloat32, {2}};
  const StreamEntry q_e{"w", torch::kInt8, {300}};
  const torch::Tensor prev = torch::zeros({300});
  int64_t got = 0;
  DeltaStreamDecoder dec(
      Compression::Int8, [&](const StreamEntry&) { return prev; },
      [&](const StreamEntry&, int64_t, const torch::Tensor& run, bool) { got += run.numel(); },
      "test");
  for (float bad : {std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN(), -1.0f, 1e38f}) {
    const torch::Tensor s = torch::tensor({0.5f, bad});
    const std::string why = error_of([&] { dec(scale_e, 0, s, true); });
    EXPECT_THAT(why, HasSubstr("tensor 'w'")) << bad;
    EXPECT_THAT(why, HasSubstr("scale")) << bad;
  }
  // Values without their scales first are refused too.
  EXPECT_THAT(error_of([&] { dec(q_e, 0, torch::zeros({300}, torch::kInt8), true); }),
              HasSubstr("needs its 2 int8 scales"));
  // A valid pair, fed in runs that cut across blocks, rebuilds prev + q * scale.
  dec(scale_e, 0, torch::tensor({0.5f, 2.0f}), true);
  const torch::Tensor q = torch::full({300}, 3, torch::kInt8);
  torch::Tensor out = torch::empty({300});
  DeltaStreamDecoder dec2(
      Compression::Int8, [&](const StreamEntry&) { return prev; },
      [&](const StreamEntry&, int64_t first, const torch::Tensor& run, bool) {
        out.slice(0, first, first + run.numel()).copy_(run);
      },
      "test");
  dec2(scale_e, 0, torch::tensor({0.5f}), false);
  dec2(scale_e, 1, torch::tensor({2.0f}), true);
  dec2(q_e, 0, q.slice(0, 0, 200), false);
  dec2(q_e, 200, q.slice(0, 200, 300), true);
  EXPECT_TRUE(torch::equal(out.slice(0, 0, 256), torch::full({256}, 1.5f)));
  EXPECT_TRUE(torch::equal(out.slice(0, 256, 300), torch::full({44}, 6.0f)));
}

// A node trains a persistent small update next to one large value per block (which sets the
// block's scale): alone, the small update is below half a quantum and quantises to 0 every
// round. With error feedback it accumulates in the residual until it is sent.
TEST(DeltaCodec, ErrorFeedbackTracksTheTrueSumWithinOneQuantum) {
  const Config cfg = tiny_config({"spes_config.compression=int8"});
  for (bool feedback : {true, false}) {
    FakeNode n(cfg, 0, 1);
    DeltaUpload up(Compression::Int8);
    up.set_base(*n.reg, true);
    std::vector<torch::Tensor> start, truth;
    for (const auto& e : n.reg->entries())
      if (e.trainable) {
        start.push_back(e.tensor.detach().clone());
        truth.push_back(torch::zeros_like(e.tensor));
      }
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> big(-0.1f, 0.1f);
    const int rounds = 200;
    for (int r = 1; r <= rounds; ++r) {
      size_t k = 0;
      torch::NoGradGuard ng;
      for (const auto& e : n.reg->entries()) {
        if (!e.trainable) continue;
        torch::Tensor g = torch::full({e.tensor.numel()}, 1e-4f);
        for (int64_t b = 0; b < e.tensor.numel(); b += kDeltaBlock) g[b] = big(rng);
        g = g.view(e.tensor.sizes());
        e.tensor.add_(g);
        truth[k++].add_(g);
      }
      up.encode(*n.reg, UploadMeta{0, r, r * 10, 1, 1, ""});
      up.apply_rebuilt(*n.reg);
      up.set_base(*n.reg, /*reset_residual=*/!feedback);
    }
    // Sent in total (the node's weights moved by exactly what it sent) vs trained in total.
    double worst = 0;
    size_t k = 0;
    for (const auto& e : n.reg->entries()) {
      if (!e.trainable) continue;
      const torch::Tensor sent = e.tensor.detach() - start[k];
      worst = std::max(worst, (sent - truth[k]).abs().max().item<double>());
      ++k;
    }
    // One quantum: scale <= (0.1 + a residual below half a quantum) / 127 ~ 8e-4; half of it
    // bounds the residual, plus fp32 rounding of 200 additions.
    if (feedback) {
      EXPECT_LT(worst, 0.5 * 0.1 / 127 * 1.02 + 2e-5);
      EXPECT_LT(std::sqrt(up.residual_sq()), 1.0);
    } else {
      EXPECT_GT(worst, 0.5 * rounds * 1e-4);  // the small update was (mostly) never sent
    }
  }
}
