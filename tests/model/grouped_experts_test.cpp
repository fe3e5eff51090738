// The grouped-GEMM expert layout (model/expert_stack, model/grouped_experts) run on CPU tensors
// against the per-expert path of the same model: the whole model's loss and every gradient in
// fp32 (with frozen experts, with an expert that gets no tokens), the layer's router statistics,
// where each expert's tensors live (views of the stack or fp32 masters), and bf16 frozen-expert
// storage under CPU autocast against the same model whose frozen experts are trainable
// tensors holding the same bf16 values.
#include <gtest/gtest.h>

#include <map>

#include "model/tiny_model_config.h"
#include "spes/model/layers.h"
#include "spes/model/losses.h"
#include "spes/train/device.h"
#include "spes/model/registry.h"

using namespace spes;

namespace {

ModelConfig grouped_tiny() {
  ModelConfig c = spes::testing::tiny_model_config();
  c.set_ffn_hidden_size(16);  // grouped GEMMs want multiples of 8
  return c;
}

Config config_with(const ModelConfig& m, std::vector<std::string> frozen = {}) {
  Config c;
  c.model = m;
  c.frozen_experts = std::move(frozen);
  return c;
}

ModelRuntime grouped_runtime(const Config& c, torch::ScalarType dt,
                             torch::ScalarType frozen = torch::kFloat32) {
  ModelRuntime rt;
  rt.grouped_dtype = dt;
  rt.trainable_experts = trainable_expert_table(c, Ownership::from_config(c), 0);
  rt.frozen_dtype = frozen;
  return rt;
}

std::map<std::string, torch::Tensor> grads_by_name(const Transformer& m) {
  std::map<std::string, torch::Tensor> g;
  for (const auto& p : m.params())
    if (p.tensor.grad().defined()) g[p.name] = p.tensor.grad().clone();
  return g;
}

double maxdiff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

// Loss and gradients of both layouts on the same tokens.
void expect_same_training_signal(const Config& cfg, const ModelRuntime& grouped,
                                 const torch::Tensor& tokens, const torch::Tensor& targets,
                                 double tol) {
  Transformer a(cfg.model), b(cfg.model, torch::kCPU, grouped);
  a.init_weights(5);
  b.init_weights(5);
  ParamRegistry ra(a, cfg, Ownership::from_config(cfg), 0);
  ParamRegistry rb(b, cfg, Ownership::from_config(cfg), 0);
  LossTerms la = compute_losses(a, tokens, targets), lb = compute_losses(b, tokens, targets);
  EXPECT_LT(maxdiff(la.total, lb.total), tol);
  EXPECT_LT(maxdiff(la.lb, lb.lb), tol);
  la.total.backward();
  lb.total.backward();
  auto ga = grads_by_name(a), gb = grads_by_name(b);
  ASSERT_EQ(ga.size(), gb.size());
  for (const auto& [name, g] : ga) {
    ASSERT_TRUE(gb.count(name)) << name;
    EXPECT_LT(maxdiff(g, gb[name]), tol) << name;
  }
}

}  // namespace

TEST(GroupedExperts, WholeModelLossAndGradientsMatchPerExpertPathFp32) {
  Config cfg = config_with(grouped_tiny());
  torch::manual_seed(1);
  torch::Tensor tokens = torch::randint(0, 32, {3, 8});
  expect_same_training_signal(cfg, grouped_runtime(cfg, torch::kFloat32), tokens,
                              torch::roll(tokens, -1, 1), 1e-5);
}

TEST(GroupedExperts, FrozenExpertsGetNoGradientAndTheRestMatch) {
  Config cfg = config_with(grouped_tiny(), {"*:1", "0:3"});
  torch::manual_seed(2);
  torch::Tensor tokens = torch::randint(0, 32, {2, 8});
  expect_same_training_signal(cfg, grouped_runtime(cfg, torch::kFloat32), tokens,
                              torch::roll(tokens, -1, 1), 1e-5);
}

TEST(GroupedExperts, LayerMatchesPerExpertLayerWithAStarvedExpert) {
  // Expert 3 can never win top-2 (a large constant feature against a very negative weight):
  // its slot has no rows, its weight gradient must be exactly zero.
  const int64_t N = 10, D = 16, F = 16, E = 4;
  torch::manual_seed(3);
  torch::Tensor x = torch::randn({N, D});
  x.select(1, 0).fill_(4.0);
  torch::Tensor router = torch::randn({E, D}) * 0.7;
  router[E - 1][0] = -50.0;
  std::vector<ExpertWeights> ref(E), grp(E);
  Config cfg = config_with(grouped_tiny());
  ExpertStack stack = expert_stack_create(grp, std::vector<bool>(E, true), D, F, torch::kFloat32,
                                          torch::kFloat32, torch::kCPU);
  for (int64_t e = 0; e < E; ++e) {
    ref[e] = {torch::randn({F, D}) * 0.5, torch::randn({F, D}) * 0.5, torch::randn({D, F}) * 0.5};
    torch::NoGradGuard ng;
    grp[e].w1.copy_(ref[e].w1);
    grp[e].v1.copy_(ref[e].v1);
    grp[e].w2.copy_(ref[e].w2);
  }
  for (auto* ws : {&ref, &grp})
    for (auto& e : *ws)
      for (auto* t : {&e.w1, &e.v1, &e.w2}) t->set_requires_grad(true);
  torch::Tensor xa = x.clone().requires_grad_(true), xb = x.clone().requires_grad_(true);
  RouterStats sa, sb;
  torch::Tensor ya = moe_forward(xa, router, ref, 2, false, &sa);
  torch::Tensor yb = moe_forward_grouped(xb, router, grp, stack, 2, false, &sb);
  EXPECT_LT(maxdiff(ya, yb), 1e-5);
  EXPECT_TRUE(torch::equal(sa.counts, sb.counts));
  EXPECT_EQ(sb.counts[E - 1].item<float>(), 0.0f);
  EXPECT_TRUE(torch::equal(sa.probs, sb.probs));
  torch::Tensor probe = torch::randn({N, D});
  (ya * probe).sum().backward();
  (yb * probe).sum().backward();
  EXPECT_LT(maxdiff(xa.grad(), xb.grad()), 1e-5);
  for (int64_t e = 0; e < E - 1; ++e) {
    EXPECT_LT(maxdiff(ref[e].w1.grad(), grp[e].w1.grad()), 1e-5) << e;
    EXPECT_LT(maxdiff(ref[e].v1.grad(), grp[e].v1.grad()), 1e-5) << e;
    EXPECT_LT(maxdiff(ref[e].w2.grad(), grp[e].w2.grad()), 1e-5) << e;
  }
  // The per-expert path leaves a starved expert without a gradient; the grouped one gives it an
  // exact zero (no host synchronisation to find out which experts got no tokens).
  EXPECT_FALSE(ref[E - 1].w1.grad().defined());
  ASSERT_TRUE(grp[E - 1].w1.grad().defined());
  EXPECT_EQ(grp[E - 1].w1.grad().abs().max().item<float>(), 0.0f);
  EXPECT_EQ(grp[E - 1].w2.grad().abs().max().item<float>(), 0.0f);
}

TEST(GroupedExperts, TrainableSlotsComeFirstAndFrozenExpertsAreViewsOfTheStack) {
  Config cfg = config_with(grouped_tiny(), {"*:0", "*:2"});
  Transformer m(cfg.model, torch::kCPU,
                grouped_runtime(cfg, torch::kBFloat16, /*frozen=*/torch::kBFloat16));
  ParamRegistry reg(m, cfg, Ownership::from_config(cfg), 0);
  for (const auto& e : reg.entries()) {
    if (e.role != ParamRole::Expert) {
      EXPECT_EQ(e.tensor.scalar_type(), torch::kFloat32) << e.name;
      continue;
    }
    const bool frozen = e.expert == 0 || e.expert == 2;
    EXPECT_EQ(e.trainable, !frozen) << e.name;
    // Frozen: bf16, no fp32 copy; trainable: fp32 masters.
    EXPECT_EQ(e.tensor.scalar_type(), frozen ? torch::kBFloat16 : torch::kFloat32) << e.name;
  }
  // Two fp32-trainable experts per layer of 3 x 16 x 16 values, nothing else in fp32 but the
  // shared tensors; the frozen experts' bytes are half of fp32.
  int64_t frozen_bytes = 0;
  for (const auto& e : reg.entries())
    if (!e.trainable) frozen_bytes += e.tensor.nbytes();
  EXPECT_EQ(frozen_bytes, 2 /*layers*/ * 2 /*experts*/ * 3 * 16 * 16 * 2 /*bytes*/);
}

TEST(GroupedExperts, Bf16FrozenStorageEqualsTrainableTensorsWithTheSameBf16Values) {
  // Model A keeps experts 1 and 3 frozen in bf16 (views of its bf16 stacks); model B trains
  // every expert (fp32 masters) but holds the same bf16-rounded values. Under bf16 autocast
  // both compute with the same bf16 operands: same loss, same gradients of shared tensors.
  Config ca = config_with(grouped_tiny(), {"*:1", "*:3"}), cb = config_with(grouped_tiny());
  Transformer a(ca.model, torch::kCPU, grouped_runtime(ca, torch::kBFloat16, torch::kBFloat16));
  Transformer b(cb.model, torch::kCPU, grouped_runtime(cb, torch::kBFloat16));
  a.init_weights(9);
  b.init_weights(9);
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < a.params().size(); ++i) b.params()[i].tensor.copy_(a.params()[i].tensor);
  }
  ParamRegistry ra(a, ca, Ownership::from_config(ca), 0), rb(b, cb, Ownership::from_config(cb), 0);
  torch::manual_seed(4);
  torch::Tensor tokens = torch::randint(0, 32, {2, 8}), targets = torch::roll(tokens, -1, 1);
  LossTerms la, lb;
  {
    AutocastScope ac(true, torch::kCPU);
    la = compute_losses(a, tokens, targets);
  }
  {
    AutocastScope ac(true, torch::kCPU);
    lb = compute_losses(b, tokens, targets);
  }
  EXPECT_EQ(la.total.item<float>(), lb.total.item<float>());
  la.total.backward();
  lb.total.backward();
  for (size_t i = 0; i < a.params().size(); ++i) {
    const auto& p = a.params()[i];
    if (p.role == ParamRole::Expert) continue;
    EXPECT_TRUE(torch::equal(p.tensor.grad(), b.params()[i].tensor.grad())) << p.name;
  }
  EXPECT_TRUE(std::isfinite(la.total.item<float>()));
}
