// Activation checkpointing (model/activation_checkpoint, ModelRuntime::checkpoint_every): the
// same loss and the same gradient for every parameter as without it, on the fused CPU path and
// on the grouped-expert path, for every block and one block in two; the auxiliary losses'
// gradients reach the routers of checkpointed blocks; nothing changes without grad mode.
#include <gtest/gtest.h>

#include "model/tiny_model_config.h"
#include "spes/model/activation_checkpoint.h"
#include "spes/model/losses.h"
#include "spes/model/registry.h"

using namespace spes;

namespace {

double maxrel(const torch::Tensor& a, const torch::Tensor& b) {
  torch::Tensor x = a.to(torch::kFloat64), y = b.to(torch::kFloat64);
  return ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item<double>();
}

void expect_same_with_checkpointing(ModelRuntime rt, int64_t every) {
  ModelConfig m = spes::testing::tiny_model_config();
  m.mlp_hidden_size = 16;
  m.n_layers = 3;
  Config cfg;
  cfg.model = m;
  cfg.frozen_experts = {"1:2"};
  Transformer a(m, torch::kCPU, rt);
  rt.checkpoint_every = every;
  Transformer b(m, torch::kCPU, rt);
  a.init_weights(3);
  b.init_weights(3);
  ParamRegistry ra(a, cfg, Ownership::from_config(cfg), 0);
  ParamRegistry rb(b, cfg, Ownership::from_config(cfg), 0);
  torch::manual_seed(6);
  torch::Tensor tokens = torch::randint(0, 32, {2, 8}), targets = torch::roll(tokens, -1, 1);
  LossTerms la = compute_losses(a, tokens, targets), lb = compute_losses(b, tokens, targets);
  EXPECT_EQ(la.total.item<double>(), lb.total.item<double>());
  la.total.backward();
  lb.total.backward();
  for (size_t i = 0; i < a.params().size(); ++i) {
    const auto& pa = a.params()[i];
    const auto& pb = b.params()[i];
    ASSERT_EQ(pa.tensor.grad().defined(), pb.tensor.grad().defined()) << pa.name;
    if (!pa.tensor.grad().defined()) continue;
    EXPECT_LT(maxrel(pb.tensor.grad(), pa.tensor.grad()), 1e-6) << pa.name << " every " << every;
  }
}

ModelRuntime grouped_fp32(const ModelConfig& m) {
  ModelRuntime rt;
  rt.grouped_dtype = torch::kFloat32;
  (void)m;
  return rt;
}

}  // namespace

TEST(ActivationCheckpoint, SameGradientsOnTheFusedCpuPath) {
  expect_same_with_checkpointing({}, 1);
  expect_same_with_checkpointing({}, 2);
}

TEST(ActivationCheckpoint, SameGradientsOnTheGroupedExpertPath) {
  expect_same_with_checkpointing(grouped_fp32(spes::testing::tiny_model_config()), 1);
}

TEST(ActivationCheckpoint, OnlyTheInputIsKeptAndNoGradModeRunsPlainly) {
  // A function that would keep a large intermediate: with checkpointing its graph holds only
  // the input (the intermediate is recomputed for backward), and the gradient is unchanged.
  torch::Tensor x = torch::randn({4, 5}).requires_grad_(true);
  torch::Tensor w = torch::randn({5, 5}).requires_grad_(true);
  int calls = 0;
  CheckpointedFn fn = [&](const torch::Tensor& in) -> std::vector<torch::Tensor> {
    ++calls;
    return {torch::tanh(in.matmul(w)).matmul(w).sum(1)};
  };
  auto y = checkpoint_apply(fn, x);
  EXPECT_EQ(calls, 1);
  y[0].sum().backward();
  EXPECT_EQ(calls, 2);  // recomputed once in backward
  torch::Tensor gx = x.grad().clone(), gw = w.grad().clone();
  x.mutable_grad().reset();
  w.mutable_grad().reset();
  fn(x)[0].sum().backward();
  EXPECT_TRUE(torch::allclose(gx, x.grad(), 0, 0));
  EXPECT_TRUE(torch::allclose(gw, w.grad(), 0, 0));
  {
    torch::NoGradGuard ng;
    calls = 0;
    auto z = checkpoint_apply(fn, x);
    EXPECT_EQ(calls, 1);
    EXPECT_FALSE(z[0].requires_grad());
  }
}
