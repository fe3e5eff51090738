// AdamW with persistent gradient buffers (what the trainer uses) against the default
// allocate-and-free gradients: the same updates, tensors that received no gradient in a step
// are skipped, buffers stay allocated (zeroed) between steps, and the fused expert kernel's
// in-GEMM accumulation into the buffers gives the same gradients as autograd's.
#include <gtest/gtest.h>

#include <vector>

#include "spes/model/layers.h"
#include "spes/train/optimizer.h"
#include "train/train_test_util.h"

using namespace spes;
using spes::test::trainable_entry;

namespace {

OptimizerConfig config() {
  OptimizerConfig oc;
  oc.betas = {0.9, 0.95};
  oc.eps = 1e-8;
  oc.weight_decay = 0.1;
  return oc;
}

}  // namespace

TEST(PersistentGrads, SameUpdatesAndSkipsTensorsWithoutGradient) {
  torch::manual_seed(5);
  torch::Tensor a0 = torch::randn({6, 4}), b0 = torch::randn({5});
  std::vector<RegistryEntry> p1 = {trainable_entry("a", a0.clone()),
                                   trainable_entry("b", b0.clone())};
  std::vector<RegistryEntry> p2 = {trainable_entry("a", a0.clone()),
                                   trainable_entry("b", b0.clone())};
  AdamW o1(p1, config()), o2(p2, config());
  o2.use_persistent_grads();
  EXPECT_TRUE(o2.persistent_grads());
  // Buffers exist from the start and are zero.
  EXPECT_TRUE(p2[0].tensor.grad().defined());
  EXPECT_EQ(p2[1].tensor.grad().abs().sum().item<double>(), 0.0);
  torch::Tensor x = torch::randn({4});
  for (int s = 0; s < 4; ++s) {
    // b gets a gradient on odd steps only; a on every step, from two backward passes
    // (accumulation).
    for (auto* ps : {&p1, &p2}) {
      torch::Tensor loss = (*ps)[0].tensor.matmul(x).pow(2).sum();
      if (s % 2 == 1) loss = loss + ((*ps)[1].tensor * 3).sin().sum();
      loss.backward();
      (*ps)[0].tensor.matmul(x).sum().backward();
    }
    const double n1 = o1.step(1e-2, 1.0), n2 = o2.step(1e-2, 1.0);
    EXPECT_DOUBLE_EQ(n1, n2);
    o1.zero_grad();
    o2.zero_grad();
    EXPECT_TRUE(torch::equal(p1[0].tensor, p2[0].tensor)) << "step " << s;
    EXPECT_TRUE(torch::equal(p1[1].tensor, p2[1].tensor)) << "step " << s;
    if (s == 0) {
      EXPECT_TRUE(torch::equal(p2[1].tensor, b0));  // skipped: no decay either
    }
    EXPECT_FALSE(p1[0].tensor.grad().defined());
    ASSERT_TRUE(p2[0].tensor.grad().defined());
    EXPECT_EQ(p2[0].tensor.grad().abs().sum().item<double>(), 0.0);
  }
  // b took two steps (its own bias correction), a four.
  auto st = o2.state_tensors();
  EXPECT_EQ(st[2].second.item<int64_t>(), 4);
  EXPECT_EQ(st[5].second.item<int64_t>(), 2);
}

TEST(PersistentGrads, ExpertKernelAccumulatesIntoBuffers) {
  torch::manual_seed(6);
  ExpertWeights e{torch::randn({12, 8}), torch::randn({12, 8}), torch::randn({8, 12})};
  ExpertWeights f{e.w1.clone(), e.v1.clone(), e.w2.clone()};
  for (auto* w : {&e.w1, &e.v1, &e.w2, &f.w1, &f.v1, &f.w2}) w->set_requires_grad(true);
  std::vector<RegistryEntry> ps = {trainable_entry("w1", f.w1),
                                   trainable_entry("v1", f.v1),
                                   trainable_entry("w2", f.w2)};
  AdamW opt(ps, config());
  opt.use_persistent_grads();
  torch::Tensor x1 = torch::randn({10, 8}), x2 = torch::randn({7, 8});
  // Reference: the composite expert, gradients accumulated by autograd.
  for (const auto& x : {x1, x2}) expert_forward_reference(e, x).pow(2).sum().backward();
  for (const auto& x : {x1, x2}) expert_forward(f, x).pow(2).sum().backward();
  // Within 1e-5 of the gradient's scale (entries reach ~1e4 here: different GEMM blockings
  // differ by an ulp of the largest entries, which is more than 1e-5 of a small one).
  for (auto [r, k] : {std::pair{e.w1, f.w1}, {e.v1, f.v1}, {e.w2, f.w2}}) {
    const double scale = r.grad().abs().max().item<double>();
    EXPECT_TRUE(torch::allclose(k.grad(), r.grad(), 1e-5, 1e-5 * scale))
        << "max diff " << (k.grad() - r.grad()).abs().max().item<double>() << " scale " << scale;
  }
  EXPECT_GT(opt.grad_norm(), 0.0);
}
