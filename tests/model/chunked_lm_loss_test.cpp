// The chunked LM-head loss (model/chunked_lm_loss.cpp) on CPU tensors against the unchunked
// composite computation (lm_losses of h W^T, autograd through it): values and gradients for
// several chunk sizes (one row, uneven, whole), ignored targets, the gradient added into a
// persistent buffer, bf16 products under CPU autocast, no gradient work without grad mode, and
// the head padded with zero rows for aligned products (what CUDA does under amp_bf16).
#include <gtest/gtest.h>

#include "spes/model/losses.h"
#include "spes/train/device.h"

using namespace spes;

namespace {

double maxrel(const torch::Tensor& a, const torch::Tensor& b) {
  torch::Tensor x = a.to(torch::kFloat64), y = b.to(torch::kFloat64);
  return ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item<double>();
}

struct Case {
  torch::Tensor h, w, targets;
};

Case make_case(int64_t N, int64_t D, int64_t V, uint64_t seed) {
  torch::manual_seed(seed);
  Case c{torch::randn({N, D}), torch::randn({V, D}) * 0.3, torch::randint(0, V, {N})};
  c.targets[1] = -1;  // ignored positions
  c.targets[N - 2] = -1;
  return c;
}

constexpr double kZ = 1e-2;  // a z-loss weight large enough to matter in the gradient

}  // namespace

TEST(ChunkedLmHeadLoss, ValuesAndGradientsMatchUnchunkedForEveryChunkSize) {
  const Case c = make_case(13, 8, 40, 1);
  torch::Tensor h0 = c.h.clone().requires_grad_(true), w0 = c.w.clone().requires_grad_(true);
  auto [ce0, z0] = lm_losses(torch::matmul(h0, w0.t()), c.targets);
  (ce0 + kZ * z0).backward();
  for (int64_t rows : {1, 4, 5, 13, 0}) {
    torch::Tensor h = c.h.clone().requires_grad_(true), w = c.w.clone().requires_grad_(true);
    LmHeadLoss r = lm_head_losses_chunked(h, w, c.targets, kZ, rows);
    EXPECT_LT(maxrel(r.ce, ce0), 1e-6) << rows;
    EXPECT_LT(maxrel(r.z, z0), 1e-6) << rows;
    EXPECT_LT(maxrel(r.total, ce0 + kZ * z0), 1e-6) << rows;
    EXPECT_FALSE(r.ce.requires_grad());
    (r.total * 0.5).backward();  // the incoming gradient scales both products
    EXPECT_LT(maxrel(h.grad(), h0.grad() * 0.5), 1e-5) << rows;
    EXPECT_LT(maxrel(w.grad(), w0.grad() * 0.5), 1e-5) << rows;
  }
}

TEST(ChunkedLmHeadLoss, HeadGradientGoesIntoAPersistentBuffer) {
  const Case c = make_case(9, 8, 24, 2);
  torch::Tensor w0 = c.w.clone().requires_grad_(true);
  auto [ce0, z0] = lm_losses(torch::matmul(c.h, w0.t()), c.targets);
  (ce0 + kZ * z0).backward();
  torch::Tensor w = c.w.clone().requires_grad_(true);
  w.mutable_grad() = torch::full_like(w, 1.0);  // what was there before is added to
  const void* buffer = w.grad().data_ptr();
  lm_head_losses_chunked(c.h, w, c.targets, kZ, 4).total.backward();
  EXPECT_EQ(w.grad().data_ptr(), buffer);
  EXPECT_LT(maxrel(w.grad() - 1.0, w0.grad()), 1e-5);
}

TEST(ChunkedLmHeadLoss, AllTargetsIgnoredGivesZeroLossAndGradient) {
  Case c = make_case(6, 8, 16, 3);
  c.targets.fill_(-1);
  torch::Tensor h = c.h.clone().requires_grad_(true);
  LmHeadLoss r = lm_head_losses_chunked(h, c.w, c.targets, kZ, 4);
  EXPECT_EQ(r.total.item<float>(), 0.0f);
  r.total.backward();
  EXPECT_EQ(h.grad().abs().max().item<float>(), 0.0f);
}

TEST(ChunkedLmHeadLoss, Bf16ProductsUnderAutocastStayClose) {
  const Case c = make_case(16, 16, 64, 4);
  auto [ce0, z0] = lm_losses(torch::matmul(c.h, c.w.t()), c.targets);
  LmHeadLoss r;
  {
    AutocastScope ac(true, torch::kCPU);
    r = lm_head_losses_chunked(c.h, c.w, c.targets, kZ, 5);
  }
  EXPECT_EQ(r.ce.scalar_type(), torch::kFloat32);  // bf16 operands, fp32 reductions
  EXPECT_LT(maxrel(r.ce, ce0), 2e-2);
  EXPECT_GT(maxrel(r.ce, ce0), 0.0);  // the products really were bf16
}

TEST(ChunkedLmHeadLoss, NoGradModeComputesOnlyTheValues) {
  const Case c = make_case(7, 8, 16, 5);
  torch::Tensor h = c.h.clone().requires_grad_(true);
  torch::NoGradGuard ng;
  LmHeadLoss r = lm_head_losses_chunked(h, c.w, c.targets, kZ, 3);
  auto [ce0, z0] = lm_losses(torch::matmul(c.h, c.w.t()), c.targets);
  EXPECT_LT(maxrel(r.ce, ce0), 1e-6);
  EXPECT_FALSE(r.total.requires_grad());
}

// The head padded with zero rows to a multiple of 8 or 64 entries (V = 43): the same values and
// gradients as the unpadded reference for every chunk size, the head's gradient of shape [V, D]
// (into the persistent buffer too), and under bf16 autocast the same as without padding.
TEST(ChunkedLmHeadLoss, HeadPaddedForAlignedProductsGivesTheSameValuesAndGradients) {
  const Case c = make_case(11, 8, 43, 6);
  torch::Tensor h0 = c.h.clone().requires_grad_(true), w0 = c.w.clone().requires_grad_(true);
  auto [ce0, z0] = lm_losses(torch::matmul(h0, w0.t()), c.targets);
  (ce0 + kZ * z0).backward();
  for (int64_t multiple : {8, 64}) {
    for (int64_t rows : {1, 5, 0}) {
      torch::Tensor h = c.h.clone().requires_grad_(true), w = c.w.clone().requires_grad_(true);
      w.mutable_grad() = torch::zeros_like(w);  // the persistent buffer
      LmHeadLoss r = lm_head_losses_chunked(h, w, c.targets, kZ, rows, multiple);
      EXPECT_LT(maxrel(r.ce, ce0), 1e-6) << multiple << " " << rows;
      EXPECT_LT(maxrel(r.z, z0), 1e-6) << multiple << " " << rows;
      r.total.backward();
      EXPECT_EQ(w.grad().sizes(), w.sizes());
      EXPECT_LT(maxrel(h.grad(), h0.grad()), 1e-5) << multiple << " " << rows;
      EXPECT_LT(maxrel(w.grad(), w0.grad()), 1e-5) << multiple << " " << rows;
    }
  }
  AutocastScope ac(true, torch::kCPU);
  torch::Tensor hp = c.h.clone().requires_grad_(true), hu = c.h.clone().requires_grad_(true);
  LmHeadLoss padded = lm_head_losses_chunked(hp, c.w, c.targets, kZ, 4, 64);
  LmHeadLoss unpadded = lm_head_losses_chunked(hu, c.w, c.targets, kZ, 4, 1);
  EXPECT_LT(maxrel(padded.ce, unpadded.ce), 1e-6);
  padded.total.backward();
  unpadded.total.backward();
  EXPECT_LT(maxrel(hp.grad(), hu.grad()), 1e-2);  // bf16 gradient products, summed differently
  EXPECT_EQ(lm_head_vocab_multiple(c.h, c.w), 1);  // no padding on the CPU by default
}
