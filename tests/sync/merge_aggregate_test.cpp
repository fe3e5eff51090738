// Aggregation and expert merging against hand-computed values, tensor by tensor: the merge
// schedule (merge points, alpha), similarity and donors (K), simultaneous update, owner copies,
// equal and token weighting, a missing owner, fedavg, the diloco outer Nesterov step (and spes's
// on the shared tensors), bf16 rounding, and what each node downloads.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <functional>

#include "spes/common/error.h"
#include "spes/sync/round/aggregate.h"
#include "spes/sync/round/merge.h"
#include "spes/sync/wire/framing.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

namespace {
std::string gate(int64_t e, int64_t l = 0) { return expert_param_name(l, e, "gate_proj"); }
std::string up(int64_t e, int64_t l = 0) { return expert_param_name(l, e, "up_proj"); }
std::string down(int64_t e, int64_t l = 0) { return expert_param_name(l, e, "down_proj"); }
const char* kEmbed = "model.embed_tokens.weight";
const char* kRouter = "model.layers.0.mlp.gate.weight";
}  // namespace

// ---- schedule ------------------------------------------------------------------------------
TEST(MergeSchedule, FirstSyncAtOrAfterEachMultipleOfTheInterval) {
  MergeSchedule s;
  s.interval = 25;
  s.clock = RoundClock(10);
  s.alpha_start = 0.5;
  s.decay_steps = 100;
  s.topk = 2;
  std::vector<int64_t> points;
  for (int64_t step = 10; step <= 120; step += 10)
    if (s.is_merge_point(step)) points.push_back(step);
  // Multiples 25, 50, 75, 100: first syncs at or after them are 30, 50, 80, 100.
  EXPECT_THAT(points, ElementsAre(30, 50, 80, 100));
  EXPECT_DOUBLE_EQ(s.alpha(30), 0.5 * (1 - 0.30));  // 0.35
  EXPECT_DOUBLE_EQ(s.alpha(50), 0.25);
  EXPECT_DOUBLE_EQ(s.alpha(80), 0.5 * (1 - 0.80));  // 0.1
  EXPECT_DOUBLE_EQ(s.alpha(100), 0.0);              // decayed to zero
  EXPECT_DOUBLE_EQ(s.alpha(40), 0.0);               // not a merge point
  // Interval equal to the sync period: every sync; interval 0: never.
  s.interval = 10;
  EXPECT_TRUE(s.is_merge_point(10) && s.is_merge_point(20));
  s.interval = 0;
  EXPECT_FALSE(s.is_merge_point(30));
  // No decay when decay_steps <= 0.
  s.interval = 25;
  s.decay_steps = 0;
  EXPECT_DOUBLE_EQ(s.alpha(1000), 0.5);
}

TEST(MergeSchedule, FromConfigOnlyInSpesMode) {
  Config c = tiny_config({"spes_config.merge_interval=20", "spes_config.merge_alpha_start=0.1",
                          "spes_config.merge_decay_steps=200"});
  MergeSchedule s = MergeSchedule::from_config(c);
  EXPECT_TRUE(s.is_merge_point(20));
  EXPECT_DOUBLE_EQ(s.alpha(20), 0.1 * 0.9);
  c.spes_config.mode = "fedavg";
  EXPECT_FALSE(MergeSchedule::from_config(c).is_merge_point(20));
}

// ---- similarity, donors, merge -------------------------------------------------------------
namespace {
ExpertMats mats(std::vector<float> g, std::vector<float> u, std::vector<float> d) {
  auto t = [](std::vector<float> v) {
    return torch::tensor(v, torch::kFloat32).reshape({1, static_cast<int64_t>(v.size())});
  };
  return {t(g), t(u), t(d)};
}
}  // namespace

TEST(Merge, GateCosineAndDonors) {
  // gate vectors: e0 = (1, 0), e1 = (1, 1), e2 = (0, 1), e3 = (-1, 0).
  std::vector<ExpertMats> ex = {mats({1, 0}, {0}, {0}), mats({1, 1}, {0}, {0}),
                                mats({0, 1}, {0}, {0}), mats({-1, 0}, {0}, {0})};
  const auto cos = gate_cosine_matrix(ex);
  const double r = 1 / std::sqrt(2.0);
  EXPECT_NEAR(cos[0][1], r, 1e-12);
  EXPECT_NEAR(cos[0][2], 0, 1e-12);
  EXPECT_NEAR(cos[0][3], -1, 1e-12);
  EXPECT_NEAR(cos[1][2], r, 1e-12);
  EXPECT_NEAR(cos[1][3], -r, 1e-12);
  EXPECT_NEAR(cos[2][3], 0, 1e-12);
  // Mean over the 6 pairs: (r + 0 - 1 + r - r + 0) / 6.
  EXPECT_NEAR(mean_pairwise(cos), (r - 1) / 6, 1e-12);
  // K = 1: the most similar other expert; e1 sees a tie (r with e0 and e2): lower index.
  EXPECT_THAT(merge_donors(cos, 1), ElementsAre(ElementsAre(1), ElementsAre(0), ElementsAre(1),
                                                ElementsAre(2)));
  // K = 2 (returned in ascending order): e0 -> {1, 2}; e1 -> {0, 2} (r, r: tie, both);
  // e2 -> {1, then tie 0 vs 3 at 0 -> lower index 0}; e3 -> {2, 1}.
  EXPECT_THAT(merge_donors(cos, 2), ElementsAre(ElementsAre(1, 2), ElementsAre(0, 2),
                                                ElementsAre(0, 1), ElementsAre(1, 2)));
  // K is clipped to E - 1.
  EXPECT_THAT(merge_donors(cos, 10)[0], ElementsAre(1, 2, 3));
}

TEST(Merge, SimultaneousTensorByTensorUpdate) {
  // Three experts with 1x1 matrices; gate values 1, 2, -3 -> cos(0,1) = 1, others -1.
  // K = 1 donors: e0 -> e1, e1 -> e0, e2 -> e0 (tie -1 vs -1: lower index).
  std::vector<ExpertMats> ex = {mats({1}, {10}, {100}), mats({2}, {20}, {200}),
                                mats({-3}, {30}, {300})};
  const auto donors = merge_donors(gate_cosine_matrix(ex), 1);
  ASSERT_THAT(donors, ElementsAre(ElementsAre(1), ElementsAre(0), ElementsAre(0)));
  experts_merge_layer(ex, donors, 0.5);
  // P_e <- 0.5 P_e + 0.5 P_donor, every value from pre-merge values:
  //   gate: e0 = 0.5*1 + 0.5*2 = 1.5; e1 = 0.5*2 + 0.5*1 = 1.5 (a sequential update would
  //   give 0.5*2 + 0.5*1.5 = 1.75); e2 = 0.5*-3 + 0.5*1 = -1.
  EXPECT_FLOAT_EQ(ex[0].gate.item<float>(), 1.5f);
  EXPECT_FLOAT_EQ(ex[1].gate.item<float>(), 1.5f);
  EXPECT_FLOAT_EQ(ex[2].gate.item<float>(), -1.0f);
  // up with up: 15, 15, 20; down with down: 150, 150, 200.
  EXPECT_FLOAT_EQ(ex[0].up.item<float>(), 15.f);
  EXPECT_FLOAT_EQ(ex[1].up.item<float>(), 15.f);
  EXPECT_FLOAT_EQ(ex[2].up.item<float>(), 20.f);
  EXPECT_FLOAT_EQ(ex[0].down.item<float>(), 150.f);
  EXPECT_FLOAT_EQ(ex[1].down.item<float>(), 150.f);
  EXPECT_FLOAT_EQ(ex[2].down.item<float>(), 200.f);
}

TEST(Merge, MeanOfKDonors) {
  // gate 1, 2, 4 all parallel (cos 1 everywhere): K = 2 donors are the two others.
  std::vector<ExpertMats> ex = {mats({1}, {1}, {1}), mats({2}, {2}, {2}), mats({4}, {4}, {4})};
  experts_merge_layer(ex, merge_donors(gate_cosine_matrix(ex), 2), 0.2);
  // e0 = 0.8*1 + 0.2*(2+4)/2 = 1.4; e1 = 0.8*2 + 0.2*(1+4)/2 = 2.1; e2 = 0.8*4 + 0.2*1.5 = 3.5
  EXPECT_FLOAT_EQ(ex[0].up.item<float>(), 1.4f);
  EXPECT_FLOAT_EQ(ex[1].up.item<float>(), 2.1f);
  EXPECT_FLOAT_EQ(ex[2].down.item<float>(), 3.5f);
}

TEST(Merge, MatchesTensorFormulaOnLargeExperts) {
  // Eight experts of 300 x 70 values (blocks of the kernel, a partial last one, several
  // threads), K = 3, against the formula written with torch ops from pre-merge copies.
  torch::manual_seed(7);
  std::vector<ExpertMats> ex, before;
  for (int e = 0; e < 8; ++e) {
    ex.push_back({torch::randn({300, 70}), torch::randn({300, 70}), torch::randn({70, 300})});
    before.push_back({ex.back().gate.clone(), ex.back().up.clone(), ex.back().down.clone()});
  }
  const auto donors = merge_donors(gate_cosine_matrix(ex), 3);
  const double alpha = 0.3;
  experts_merge_layer(ex, donors, alpha);
  for (auto member : {&ExpertMats::gate, &ExpertMats::up, &ExpertMats::down})
    for (size_t e = 0; e < ex.size(); ++e) {
      torch::Tensor mean = torch::zeros_like(before[e].*member);
      for (int64_t d : donors[e]) mean += before[static_cast<size_t>(d)].*member;
      mean /= static_cast<double>(donors[e].size());
      const torch::Tensor want = (before[e].*member) * (1 - alpha) + mean * alpha;
      EXPECT_TRUE(torch::allclose(ex[e].*member, want, 1e-6, 1e-6)) << "expert " << e;
      EXPECT_FALSE(torch::equal(ex[e].*member, before[e].*member)) << "expert " << e;
    }
}

// ---- aggregation ---------------------------------------------------------------------------
TEST(Aggregate, SharedMeanAndOwnerCopies) {
  SyncModel m(tiny_config());
  RoundAggregator agg(m);
  agg.begin(1, 10);
  // Node 0: shared tensors 1.0, its experts (0, 1) 10 + e; node 1: shared 3.0, experts 20 + e.
  fold_filled(agg, m.plan(), 0, 80, [](const PlanTensor& t) {
    return full(t, t.role == ParamRole::Expert ? 10 + t.expert : 1.0);
  });
  fold_filled(agg, m.plan(), 1, 80, [](const PlanTensor& t) {
    return full(t, t.role == ParamRole::Expert ? 20 + t.expert : 3.0);
  });
  const RoundOutcome o = agg.finish();
  EXPECT_THAT(o.nodes, ElementsAre(0, 1));
  EXPECT_DOUBLE_EQ(o.alpha, 0);
  EXPECT_DOUBLE_EQ(uniform_value(m, kEmbed), 2.0);   // (1 + 3) / 2
  EXPECT_DOUBLE_EQ(uniform_value(m, kRouter), 2.0);
  EXPECT_DOUBLE_EQ(uniform_value(m, gate(0)), 10);   // owner node 0's copy
  EXPECT_DOUBLE_EQ(uniform_value(m, up(1)), 11);
  EXPECT_DOUBLE_EQ(uniform_value(m, down(2)), 22);   // owner node 1's copy
  EXPECT_DOUBLE_EQ(uniform_value(m, gate(3)), 23);
}

TEST(Aggregate, TokenWeightedMean) {
  SyncModel m(tiny_config({"spes_config.weighting=tokens"}));
  RoundAggregator agg(m);
  agg.begin(1, 10);
  fold_filled(agg, m.plan(), 0, 100, [](const PlanTensor& t) { return full(t, 1.0); });
  fold_filled(agg, m.plan(), 1, 300, [](const PlanTensor& t) { return full(t, 3.0); });
  const RoundOutcome o = agg.finish();
  EXPECT_THAT(o.weights, ElementsAre(100, 300));
  EXPECT_DOUBLE_EQ(uniform_value(m, kEmbed), 2.5);   // (100*1 + 300*3) / 400
  EXPECT_DOUBLE_EQ(uniform_value(m, gate(0)), 1.0);  // experts are still owner copies
  EXPECT_DOUBLE_EQ(uniform_value(m, gate(2)), 3.0);
}

TEST(Aggregate, MissingOwnerKeepsLastPublishedValue) {
  SyncModel m(tiny_config());
  const torch::Tensor before = m.tensors()[m.plan().index(gate(3))].clone();
  RoundAggregator agg(m);
  agg.begin(1, 10);
  fold_filled(agg, m.plan(), 0, 80, [](const PlanTensor& t) { return full(t, 5.0); });
  agg.finish();  // node 1 absent
  EXPECT_DOUBLE_EQ(uniform_value(m, kEmbed), 5.0);  // mean over the nodes present
  EXPECT_DOUBLE_EQ(uniform_value(m, gate(1)), 5.0);
  EXPECT_TRUE(torch::equal(m.tensors()[m.plan().index(gate(3))], before));
}

TEST(Aggregate, NodesFoldOnceEachInAscendingOrderWithTheirOwnTensors) {
  SyncModel m(tiny_config());
  RoundAggregator agg(m);
  agg.begin(1, 10);
  fold_filled(agg, m.plan(), 1, 80, [](const PlanTensor& t) { return full(t, 1.0); });
  EXPECT_THROW(agg.begin_node(0, 80), Error);  // out of order
  agg.abort();
  agg.begin(1, 10);
  agg.begin_node(0, 80);
  try {
    agg.add(gate(2), torch::zeros({4, 8}));  // node 1's expert
    FAIL() << "accepted another node's expert";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("not in its upload set"));
  }
}

TEST(Aggregate, FedAvgAveragesEverything) {
  SyncModel m(tiny_config({"spes_config.mode=fedavg"}));
  EXPECT_EQ(m.plan().upload_of(0).size(), m.plan().tensors().size());
  RoundAggregator agg(m);
  agg.begin(1, 10);
  fold_filled(agg, m.plan(), 0, 80, [](const PlanTensor& t) { return full(t, 1.0); });
  fold_filled(agg, m.plan(), 1, 80, [](const PlanTensor& t) { return full(t, 2.0); });
  agg.finish();
  for (const auto& t : m.plan().tensors()) EXPECT_DOUBLE_EQ(uniform_value(m, t.name), 1.5) << t.name;
}

namespace {
// Sets every tensor of `m` to the constant v.
void fill_model(SyncModel& m, double v) {
  NamedTensors all;
  for (const auto& t : m.plan().tensors()) all.emplace_back(t.name, full(t, v));
  m.load(all, "test");
}
// Round `round` (step 10 x round) in which node 0 sends every tensor as the constant a and
// node 1 as b.
void two_node_round(SyncModel& m, int64_t round, double a, double b) {
  RoundAggregator agg(m);
  agg.begin(round, 10 * round);
  fold_filled(agg, m.plan(), 0, 80, [a](const PlanTensor& t) { return full(t, a); });
  fold_filled(agg, m.plan(), 1, 80, [b](const PlanTensor& t) { return full(t, b); });
  agg.finish();
}
// Tensor t's values drawn from `seed` and its name: every node and round its own.
torch::Tensor random_values(const PlanTensor& t, int64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(
      static_cast<uint64_t>(seed) * 7919 + std::hash<std::string>{}(t.name));
  return torch::randn(t.shape, gen, torch::kFloat32);
}
}  // namespace

TEST(Aggregate, DilocoOuterNesterovStep) {
  SyncModel m(tiny_config({"spes_config.mode=diloco"}));  // outer lr 0.7, momentum 0.9
  fill_model(m, 1.0);
  // Round 1: prev 1, avg (0.25 + 0.75) / 2 = 0.5 -> delta 0.5, m = 0.5,
  // new = 1 - 0.7 * (0.5 + 0.9 * 0.5) = 0.335.
  two_node_round(m, 1, 0.25, 0.75);
  EXPECT_NEAR(uniform_value(m, kEmbed), 0.335, 1e-6);
  EXPECT_NEAR(uniform_value(m, gate(3)), 0.335, 1e-6);  // experts too (no owners in diloco)
  EXPECT_NEAR(m.momentum()[m.plan().index(kEmbed)].max().item<double>(), 0.5, 1e-6);
  // Round 2: prev 0.335, avg 0.135 -> delta 0.2, m = 0.9*0.5 + 0.2 = 0.65,
  // new = 0.335 - 0.7 * (0.2 + 0.9 * 0.65) = -0.2145.
  two_node_round(m, 2, 0.135, 0.135);
  EXPECT_NEAR(uniform_value(m, kEmbed), -0.2145, 1e-6);
  EXPECT_NEAR(m.momentum()[m.plan().index(kEmbed)].max().item<double>(), 0.65, 1e-6);
}

// Mode spes with outer_step: the same Nesterov step on the averaged (shared) tensors, while an
// expert is still exactly its owner's copy and keeps no momentum.
TEST(Aggregate, SpesOuterStepMovesOnlyTheSharedTensors) {
  SyncModel m(tiny_config({"spes_config.outer_step=true"}));  // outer lr 0.7, momentum 0.9
  fill_model(m, 1.0);
  two_node_round(m, 1, 0.25, 0.75);
  // Shared: prev 1, avg 0.5 -> 1 - 0.7 * (0.5 + 0.9 * 0.5) = 0.335 (as in the diloco test).
  EXPECT_NEAR(uniform_value(m, kEmbed), 0.335, 1e-6);
  EXPECT_NEAR(uniform_value(m, kRouter), 0.335, 1e-6);
  EXPECT_DOUBLE_EQ(uniform_value(m, gate(0)), 0.25);  // node 0's expert, as it sent it
  EXPECT_DOUBLE_EQ(uniform_value(m, down(3)), 0.75);  // node 1's
  EXPECT_TRUE(m.momentum()[m.plan().index(kEmbed)].defined());
  EXPECT_FALSE(m.momentum()[m.plan().index(gate(0))].defined());
  // Without outer_step, mode spes is the plain mean.
  SyncModel plain(tiny_config());
  fill_model(plain, 1.0);
  two_node_round(plain, 1, 0.25, 0.75);
  EXPECT_DOUBLE_EQ(uniform_value(plain, kEmbed), 0.5);
}

// DiLoCo's outer step with outer lr 1 and no momentum is the plain average: the published
// model must equal FedAvg's bit for bit, round after round, on values with no exact sums.
TEST(Aggregate, DilocoWithOuterLrOneAndNoMomentumIsFedAvgBitForBit) {
  SyncModel diloco(tiny_config({"spes_config.mode=diloco", "spes_config.outer_lr=1",
                                "spes_config.outer_momentum=0"}));
  SyncModel fedavg(tiny_config({"spes_config.mode=fedavg"}));
  NamedTensors start;
  for (const auto& t : diloco.plan().tensors()) start.emplace_back(t.name, random_values(t, 7));
  diloco.load(start, "test");
  fedavg.load(start, "test");
  for (int64_t round = 1; round <= 3; ++round) {
    for (SyncModel* m : {&diloco, &fedavg}) {
      RoundAggregator agg(*m);
      agg.begin(round, 10 * round);
      for (int64_t node = 0; node < 2; ++node)
        fold_filled(agg, m->plan(), node, 80,
                    [&](const PlanTensor& t) { return random_values(t, 10 * round + node); });
      agg.finish();
    }
    for (size_t i = 0; i < fedavg.tensors().size(); ++i)
      ASSERT_TRUE(torch::equal(diloco.tensors()[i], fedavg.tensors()[i]))
          << "round " << round << ": " << fedavg.plan().tensors()[i].name;
  }
}

// rounds.jsonl's "outer": the cosine between a round's outer change (published before -
// average) and the momentum before that round's update, over every tensor the outer step moved,
// against the same sums taken directly from the tensors (spes mode with outer_step: the shared
// tensors only). The first round has no momentum yet; without the outer step nothing is reported.
TEST(Aggregate, OuterMomentumCosineIsTheRoundsChangeAgainstTheMomentumBeforeIt) {
  SyncModel m(tiny_config({"spes_config.outer_step=true"}));  // outer lr 0.7, momentum 0.9
  NamedTensors start;
  for (const auto& t : m.plan().tensors()) start.emplace_back(t.name, random_values(t, 7));
  m.load(start, "test");
  for (int64_t round = 1; round <= 3; ++round) {
    std::vector<torch::Tensor> before, momentum;
    for (size_t i = 0; i < m.tensors().size(); ++i) {
      before.push_back(m.tensors()[i].clone());
      momentum.push_back(m.momentum()[i].defined() ? m.momentum()[i].clone() : torch::Tensor());
    }
    RoundAggregator agg(m);
    agg.begin(round, 10 * round);
    for (int64_t node = 0; node < 2; ++node)
      fold_filled(agg, m.plan(), node, 80,
                  [&](const PlanTensor& t) { return random_values(t, 10 * round + node); });
    const RoundOutcome o = agg.finish();
    double dot = 0, dd = 0, mm = 0;
    int moved = 0;
    for (size_t i = 0; i < m.tensors().size(); ++i) {
      const PlanTensor& t = m.plan().tensors()[i];
      if (t.rule != Combine::Mean) continue;
      ++moved;
      const torch::Tensor avg =
          (random_values(t, 10 * round).to(torch::kDouble) + random_values(t, 10 * round + 1).to(torch::kDouble)) / 2;
      const torch::Tensor delta = before[i].to(torch::kDouble) - avg;
      dd += delta.square().sum().item<double>();
      if (!momentum[i].defined()) continue;
      dot += (delta * momentum[i].to(torch::kDouble)).sum().item<double>();
      mm += momentum[i].to(torch::kDouble).square().sum().item<double>();
    }
    ASSERT_GT(moved, 0);
    EXPECT_NEAR(o.outer_change_norm, std::sqrt(dd), 1e-5 * std::sqrt(dd)) << round;
    EXPECT_NEAR(o.outer_momentum_norm, std::sqrt(mm), 1e-5 * std::sqrt(mm) + 1e-12) << round;
    if (round == 1) {
      EXPECT_TRUE(std::isnan(o.outer_momentum_cos));
      continue;
    }
    const double cos = dot / std::sqrt(dd * mm);
    EXPECT_NEAR(o.outer_momentum_cos, cos, 1e-5) << round;
    EXPECT_GT(std::abs(cos), 1e-3) << "a test whose cosine is zero could not tell";
  }
  SyncModel plain(tiny_config());
  RoundAggregator agg(plain);
  agg.begin(1, 10);
  for (int64_t node = 0; node < 2; ++node)
    fold_filled(agg, plain.plan(), node, 80, [&](const PlanTensor& t) { return random_values(t, node); });
  const RoundOutcome o = agg.finish();
  EXPECT_TRUE(std::isnan(o.outer_change_norm));
  EXPECT_TRUE(std::isnan(o.outer_momentum_cos));
}

TEST(Aggregate, MergeAtAMergePointTensorByTensor) {
  SyncModel m(tiny_config({"spes_config.merge_interval=10", "spes_config.merge_alpha_start=0.5",
                           "spes_config.merge_decay_steps=0", "spes_config.merge_topk=1"}));
  RoundAggregator agg(m);
  agg.begin(1, 10);
  // gate_proj constants +1, +2, -1, -3: cos(0,1) = 1 = cos(2,3), every other pair -1.
  // K = 1 donors: 0 -> 1, 1 -> 0, 2 -> 3, 3 -> 2. up = 10(e+1), down = 100(e+1).
  const double g[4] = {1, 2, -1, -3};
  auto value = [&](const PlanTensor& t) {
    if (t.role != ParamRole::Expert) return full(t, 0.5);
    if (t.name == gate(t.expert)) return full(t, g[t.expert]);
    if (t.name == up(t.expert)) return full(t, 10.0 * (t.expert + 1));
    return full(t, 100.0 * (t.expert + 1));
  };
  fold_filled(agg, m.plan(), 0, 80, value);
  fold_filled(agg, m.plan(), 1, 80, value);
  const RoundOutcome o = agg.finish();
  EXPECT_TRUE(o.merged);
  EXPECT_DOUBLE_EQ(o.alpha, 0.5);
  ASSERT_EQ(o.gate_cos_before.size(), 1u);
  EXPECT_NEAR(o.gate_cos_before[0], (1 - 1 - 1 - 1 - 1 + 1) / 6.0, 1e-12);  // -1/3
  // gate: 0.5*1 + 0.5*2 = 1.5 (twice), 0.5*-1 + 0.5*-3 = -2 (twice).
  EXPECT_DOUBLE_EQ(uniform_value(m, gate(0)), 1.5);
  EXPECT_DOUBLE_EQ(uniform_value(m, gate(1)), 1.5);
  EXPECT_DOUBLE_EQ(uniform_value(m, gate(2)), -2);
  EXPECT_DOUBLE_EQ(uniform_value(m, gate(3)), -2);
  // up with up: (10 + 20) / 2 = 15, 15, (30 + 40) / 2 = 35, 35; down with down: 150 ... 350.
  EXPECT_DOUBLE_EQ(uniform_value(m, up(0)), 15);
  EXPECT_DOUBLE_EQ(uniform_value(m, up(3)), 35);
  EXPECT_DOUBLE_EQ(uniform_value(m, down(1)), 150);
  EXPECT_DOUBLE_EQ(uniform_value(m, down(2)), 350);
  EXPECT_DOUBLE_EQ(uniform_value(m, kEmbed), 0.5);  // merging touches experts only
  // After the merge the gate vectors are 1.5, 1.5, -2, -2: mean cosine again -1/3.
  EXPECT_NEAR(o.gate_cos[0], -1.0 / 3, 1e-12);
  // Merged rounds send every expert back; other rounds skip the node's own experts.
  EXPECT_EQ(m.plan().download_for(0, true).size(), m.plan().tensors().size());
  const auto plain = m.plan().download_for(0, false);
  EXPECT_EQ(plain.size(), m.plan().tensors().size() - 6);  // 2 own experts x 3 matrices
  for (size_t i : plain) EXPECT_NE(m.plan().tensors()[i].owner, 0);
}

TEST(Aggregate, Bf16TransferPublishesBf16Values) {
  SyncModel m(tiny_config({"spes_config.transfer_dtype=bf16"}));
  for (const auto& t : m.tensors())  // the initial model already is what the wire carries
    EXPECT_TRUE(torch::equal(t, t.to(torch::kBFloat16).to(torch::kFloat32)));
  RoundAggregator agg(m);
  agg.begin(1, 10);
  // 1 and 1 + 2^-7 are bf16 values; their mean 1 + 2^-8 is not and rounds (to even) to 1.
  fold_filled(agg, m.plan(), 0, 80, [](const PlanTensor& t) { return full(t, 1.0); });
  fold_filled(agg, m.plan(), 1, 80,
              [](const PlanTensor& t) { return full(t, 1.0 + std::ldexp(1.0, -7)); });
  agg.finish();
  EXPECT_DOUBLE_EQ(uniform_value(m, kEmbed), 1.0);
  EXPECT_DOUBLE_EQ(uniform_value(m, gate(2)), 1.0 + std::ldexp(1.0, -7));
}

// The server's path: uploads staged as files, owner copies read back from them in finish()
// (only their sections, without compression), in fp32 and in bf16 on the wire. Each expert is
// published exactly as its owner sent it, and the round's change of it is ||new - old||,
// against an independent double-precision computation.
TEST(Aggregate, OwnerCopiesFromStagedFilesArePublishedExactlyWithTheirChange) {
  for (const char* wire : {"fp32", "bf16"}) {
    TempDir dir;
    const Config cfg = tiny_config({std::string("spes_config.transfer_dtype=") + wire});
    SyncModel m(cfg);
    const std::vector<torch::Tensor> before = [&] {
      std::vector<torch::Tensor> v;
      for (const auto& t : m.tensors()) v.push_back(t.clone());
      return v;
    }();
    std::vector<std::unique_ptr<FakeNode>> nodes;
    std::vector<std::string> files;
    for (int64_t k = 0; k < m.plan().num_nodes(); ++k) {
      nodes.push_back(std::make_unique<FakeNode>(cfg, k, 50 + k));
      const std::string path = dir.path + "/node" + std::to_string(k) + ".safetensors";
      write_stream_file(path, node_upload_writer(*nodes.back()->reg,
                                                 {k, 1, 10, 80, nodes.back()->id.incarnation,
                                                  nodes.back()->reg->fingerprint()},
                                                 std::string(wire) == "bf16" ? WireDtype::BF16
                                                                             : WireDtype::F32));
      files.push_back(path);
    }
    RoundAggregator agg(m);
    agg.begin(1, 10);
    for (int64_t k = 0; k < m.plan().num_nodes(); ++k)
      fold_upload_file(agg, m.plan(), files[k], k);
    const RoundOutcome o = agg.finish();
    int checked = 0;
    for (size_t i = 0; i < m.tensors().size(); ++i) {
      const PlanTensor& t = m.plan().tensors()[i];
      if (t.rule != Combine::OwnerCopy) continue;
      torch::Tensor sent = nodes[t.owner]->reg->find(t.name)->tensor.detach();
      if (std::string(wire) == "bf16") sent = sent.to(torch::kBFloat16).to(torch::kFloat32);
      EXPECT_TRUE(torch::equal(m.tensors()[i], sent)) << wire << " " << t.name;
      const double want =
          (sent.to(torch::kFloat64) - before[i].to(torch::kFloat64)).norm().item<double>();
      EXPECT_NEAR(o.change[i], want, 1e-12 * std::max(1.0, want)) << wire << " " << t.name;
      ++checked;
    }
    EXPECT_GT(checked, 0);
  }
}

TEST(Aggregate, SectionFoldOfCheckedUploadsEqualsTheStreamingFold) {
  // The server folds staged, checked uploads by reading the averaged tensors' sections only
  // (fold_upload_file with values_checked); `spes aggregate` streams them whole. Same bits, same
  // change, for fp32 and bf16 on the wire; the embedding (70000 x 8 values) spans several
  // 64K-value pieces and ends in a partial one.
  for (const char* wire : {"fp32", "bf16"}) {
    TempDir dir;
    const Config cfg = tiny_config({std::string("spes_config.transfer_dtype=") + wire,
                                    "model.vocab_size=70000", "spes_config.weighting=tokens"});
    SyncModel streamed(cfg), sections(cfg);
    std::vector<std::string> files;
    for (int64_t k = 0; k < streamed.plan().num_nodes(); ++k) {
      FakeNode node(cfg, k, 70 + k);
      const std::string path = dir.path + "/node" + std::to_string(k) + ".safetensors";
      write_stream_file(path, node_upload_writer(*node.reg, {k, 1, 10, 80 + 40 * k,
                                                             node.id.incarnation,
                                                             node.reg->fingerprint()},
                                                 std::string(wire) == "bf16" ? WireDtype::BF16
                                                                             : WireDtype::F32));
      files.push_back(path);
    }
    RoundOutcome o[2];
    SyncModel* models[2] = {&streamed, &sections};
    for (int way = 0; way < 2; ++way) {
      RoundAggregator agg(*models[way]);
      agg.begin(1, 10);
      for (int64_t k = 0; k < streamed.plan().num_nodes(); ++k) {
        const UploadMeta meta = fold_upload_file(agg, models[way]->plan(), files[k], k,
                                                 /*values_checked=*/way == 1);
        EXPECT_EQ(meta.tokens, 80 + 40 * k);
      }
      o[way] = agg.finish();
    }
    EXPECT_EQ(o[0].weights, o[1].weights);
    EXPECT_EQ(o[0].change, o[1].change) << wire;
    for (size_t i = 0; i < streamed.tensors().size(); ++i)
      EXPECT_TRUE(torch::equal(streamed.tensors()[i], sections.tensors()[i]))
          << wire << " " << streamed.plan().tensors()[i].name;
    EXPECT_EQ(streamed.weights_sha256(), sections.weights_sha256());
    // The fold changed the model (the nodes' values are not the initial ones).
    EXPECT_NE(streamed.weights_sha256(), SyncModel(cfg).weights_sha256());
  }
}

TEST(Aggregate, SameSeedSameInitialModelAndDigestMatchesANodeRegistry) {
  SyncModel a(tiny_config()), b(tiny_config());
  EXPECT_EQ(a.weights_sha256(), b.weights_sha256());
  SyncModel c(tiny_config({"seed=7"}));
  EXPECT_NE(a.weights_sha256(), c.weights_sha256());
  // A node's registry over a model holding the same weights gives the same digest.
  const Config cfg = tiny_config({"seed=99"});
  Transformer node_model(cfg.model);
  node_model.init_weights(99);
  ParamRegistry reg(node_model, cfg, Ownership::from_config(cfg), 1);
  EXPECT_NE(reg.weights_sha256(), a.weights_sha256());
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < reg.entries().size(); ++i) reg.entries()[i].tensor.copy_(a.tensors()[i]);
  }
  EXPECT_EQ(reg.weights_sha256(), a.weights_sha256());
  EXPECT_EQ(reg.fingerprint(), a.model_fingerprint());
}
