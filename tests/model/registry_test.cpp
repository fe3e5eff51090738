// Expert ownership (contiguous default, explicit maps, validation errors), frozen_experts
// parsing, what a SPES node trains (requires_grad, gradients, optimizer state bytes), and the
// registry's fingerprint and weight digest.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/Parallel.h>

#include <set>

#include "spes/common/error.h"
#include "spes/io/files.h"
#include "spes/model/losses.h"
#include "spes/model/ownership.h"
#include "spes/model/registry.h"
#include "spes/train/optimizer.h"

using namespace spes;
using ::testing::HasSubstr;

namespace {

Config spes_config(int64_t E, int64_t N, int64_t L = 2) {
  Config c;
  c.model.d_model = 16;
  c.model.n_layers = L;
  c.model.n_heads = 2;
  c.model.mlp_hidden_size = 24;
  c.model.moe_num_experts = E;
  c.model.moe_top_k = 2;
  c.model.vocab_size = 32;
  c.model.max_sequence_length = 8;
  c.spes_config.mode = "spes";
  c.spes_config.num_peers = N;
  return c;
}

std::string ownership_error(const Config& c) {
  try {
    Ownership::from_config(c);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::string frozen_error(const Config& c) {
  try {
    frozen_expert_table(c);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// The batch used by the gradient tests.
std::pair<torch::Tensor, torch::Tensor> batch(int64_t vocab) {
  torch::manual_seed(12);
  torch::Tensor tokens = torch::randint(0, vocab, {2, 8}, torch::kInt64);
  torch::Tensor targets = torch::full({2, 8}, -1, torch::kInt64);
  targets.narrow(1, 0, 7).copy_(tokens.narrow(1, 1, 7));
  return {tokens, targets};
}

}  // namespace

TEST(OwnershipConfig, ContiguousDefault) {
  Config c = spes_config(8, 4, 3);
  Ownership o = Ownership::from_config(c);
  EXPECT_EQ(o.num_nodes(), 4);
  EXPECT_EQ(o.num_layers(), 3);
  EXPECT_EQ(o.num_experts(), 8);
  for (int64_t l = 0; l < 3; ++l) {
    for (int64_t e = 0; e < 8; ++e) EXPECT_EQ(o.owner(l, e), e / 2);
    for (int64_t i = 0; i < 4; ++i)
      EXPECT_EQ(o.experts_of(i, l), (std::vector<int64_t>{2 * i, 2 * i + 1}));
  }
  // The same map declared explicitly has the same fingerprint; another map does not.
  Config explicit_c = c;
  explicit_c.spes_config.expert_owners = {{0, 0, 1, 1, 2, 2, 3, 3}};
  EXPECT_EQ(Ownership::from_config(explicit_c).fingerprint(), o.fingerprint());
  explicit_c.spes_config.expert_owners = {{0, 1, 0, 1, 2, 3, 2, 3}};
  EXPECT_NE(Ownership::from_config(explicit_c).fingerprint(), o.fingerprint());
  // Consistent num_train_experts_per_node is accepted.
  c.spes_config.num_train_experts_per_node = 2;
  EXPECT_EQ(Ownership::from_config(c).table(), o.table());
}

TEST(OwnershipConfig, ExplicitMaps) {
  Config c = spes_config(6, 4, 2);  // uneven: allowed with an explicit map
  c.spes_config.expert_owners = {{3, 0, 0, 1, 2, 0}};
  Ownership o = Ownership::from_config(c);
  for (int64_t l = 0; l < 2; ++l) {
    EXPECT_EQ(o.experts_of(0, l), (std::vector<int64_t>{1, 2, 5}));
    EXPECT_EQ(o.experts_of(3, l), (std::vector<int64_t>{0}));
  }
  c.spes_config.expert_owners = {{0, 0, 0, 1, 2, 3}, {3, 2, 1, 0, 0, 0}};
  Ownership p = Ownership::from_config(c);
  EXPECT_EQ(p.experts_of(0, 0), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(p.experts_of(0, 1), (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(p.owner(1, 0), 3);
  EXPECT_NE(p.fingerprint(), o.fingerprint());
}

TEST(OwnershipConfig, Errors) {
  Config c = spes_config(6, 4);
  EXPECT_THAT(ownership_error(c), HasSubstr("cannot be split evenly"));
  EXPECT_THAT(ownership_error(c), HasSubstr("expert_owners"));

  c = spes_config(8, 4);
  c.spes_config.expert_owners = {{0, 0, 1, 1, 2, 2, 3, 4}};
  EXPECT_THAT(ownership_error(c), HasSubstr("owned by node 4, outside [0, 4)"));
  c.spes_config.expert_owners = {{0, 0, 1, 1, 2, 2, 3, -1}};
  EXPECT_THAT(ownership_error(c), HasSubstr("outside [0, 4)"));

  c.spes_config.expert_owners = {{0, 0, 1, 1, 2, 2, 3}};
  EXPECT_THAT(ownership_error(c), HasSubstr("has 7 entries"));
  c.spes_config.expert_owners = {{0, 0, 1, 1, 2, 2, 3, 3}, {0, 0, 1, 1, 2, 2, 3}};
  EXPECT_THAT(ownership_error(c), HasSubstr("row for layer 1 has 7 entries"));
  c.spes_config.expert_owners = {{0, 0, 1, 1, 2, 2, 3, 3}, {0, 0, 1, 1, 2, 2, 3, 3},
                                 {0, 0, 1, 1, 2, 2, 3, 3}};
  EXPECT_THAT(ownership_error(c), HasSubstr("expected 1 row (all layers) or 2 rows"));

  c = spes_config(8, 4);
  c.spes_config.num_train_experts_per_node = 3;
  EXPECT_THAT(ownership_error(c), HasSubstr("num_train_experts_per_node=3"));
  EXPECT_THAT(ownership_error(c), HasSubstr("moe_num_experts=8"));

  EXPECT_THROW(Ownership(0, {{0}}), Error);
}

TEST(FrozenExperts, SpecParsing) {
  Config c = spes_config(4, 2);
  c.frozen_experts = {"1:3"};
  auto t = frozen_expert_table(c);
  ASSERT_EQ(t.size(), 2u);
  ASSERT_EQ(t[0].size(), 4u);
  for (int l = 0; l < 2; ++l)
    for (int e = 0; e < 4; ++e) EXPECT_EQ(t[l][e], l == 1 && e == 3) << l << ":" << e;
  c.frozen_experts = {"*:0"};
  t = frozen_expert_table(c);
  for (int l = 0; l < 2; ++l)
    for (int e = 0; e < 4; ++e) EXPECT_EQ(t[l][e], e == 0) << l << ":" << e;
  c.frozen_experts = {"0:*", "1:2"};
  t = frozen_expert_table(c);
  for (int l = 0; l < 2; ++l)
    for (int e = 0; e < 4; ++e) EXPECT_EQ(t[l][e], l == 0 || e == 2) << l << ":" << e;
  c.frozen_experts = {};
  t = frozen_expert_table(c);
  for (const auto& row : t)
    for (bool f : row) EXPECT_FALSE(f);

  for (const std::string bad : {"1", "1:2:3", "x:1", "1:y", "2:0", "0:4", "-1:0", ":1", "1:"}) {
    c.frozen_experts = {bad};
    const std::string msg = frozen_error(c);
    EXPECT_THAT(msg, HasSubstr("frozen_experts")) << bad;
    EXPECT_THAT(msg, HasSubstr("'" + bad + "'")) << bad;
  }
  c.frozen_experts = {"2:0"};
  EXPECT_THAT(frozen_error(c), HasSubstr("[0, 2)"));
  c.frozen_experts = {"0:4"};
  EXPECT_THAT(frozen_error(c), HasSubstr("[0, 4)"));
}

// Node 1 of 2 (E = 4): trains the shared tensors and experts 2, 3 of every layer only.
TEST(RegistrySpesNode, TrainsExactlyItsExpertsAndShared) {
  Config cfg = spes_config(4, 2);
  cfg.spes_config.peer_id = 1;
  Transformer model(cfg.model);
  model.init_weights(1);
  Ownership own = Ownership::from_config(cfg);
  ParamRegistry reg(model, cfg, own, 1);
  EXPECT_EQ(reg.node_id(), 1);
  ASSERT_EQ(reg.entries().size(), model.params().size());
  int64_t expect_frozen = 0;
  for (size_t i = 0; i < reg.entries().size(); ++i) {
    const auto& e = reg.entries()[i];
    EXPECT_EQ(e.name, model.params()[i].name);
    EXPECT_TRUE(e.tensor.is_same(model.params()[i].tensor)) << e.name;
    const bool expert = e.name.find(".mlp.experts.") != std::string::npos;
    const bool mine = expert && (e.expert == 2 || e.expert == 3);
    EXPECT_EQ(e.trainable, !expert || mine) << e.name;
    EXPECT_EQ(e.tensor.requires_grad(), e.trainable) << e.name;
    EXPECT_EQ(e.owner, expert ? e.expert / 2 : -1) << e.name;
    if (!e.trainable) expect_frozen += e.tensor.numel();
    EXPECT_EQ(reg.find(e.name), &e);
  }
  EXPECT_EQ(reg.find("no.such.tensor"), nullptr);
  EXPECT_EQ(expect_frozen, 2 /*layers*/ * 2 /*experts*/ * 3 * 12 * 16);
  EXPECT_EQ(reg.frozen_numel(), expect_frozen);
  EXPECT_EQ(reg.trainable_numel(), model.num_params() - expect_frozen);
  auto tr = reg.trainable();
  std::set<std::string> tr_names;
  for (const auto& e : tr) tr_names.insert(e.name);
  EXPECT_TRUE(tr_names.count("model.layers.1.mlp.experts.3.down_proj.weight"));
  EXPECT_FALSE(tr_names.count("model.layers.1.mlp.experts.1.down_proj.weight"));
  EXPECT_TRUE(tr_names.count("model.layers.0.mlp.gate.weight"));

  // Gradients after one backward: frozen tensors none; trainable ones all, except experts that
  // received no token in this batch.
  auto [tokens, targets] = batch(32);
  ForwardResult fr = model.forward(tokens);
  compute_losses(model, tokens, targets).total.backward();
  for (const auto& e : reg.entries()) {
    if (!e.trainable) {
      EXPECT_FALSE(e.tensor.grad().defined()) << e.name;
      continue;
    }
    bool expect_grad = true;
    if (e.role == ParamRole::Expert)
      expect_grad = fr.routers[e.layer].counts[e.expert].item<double>() > 0;
    EXPECT_EQ(e.tensor.grad().defined(), expect_grad) << e.name;
    if (expect_grad) {
      EXPECT_GT(e.tensor.grad().abs().sum().item<double>(), 0.0) << e.name;
    }
  }

  // Optimizer state: two fp32 moments per trainable element, nothing for frozen tensors.
  AdamW opt(reg.trainable(), cfg.optimizer);
  EXPECT_EQ(opt.state_bytes(), 2 * 4 * reg.trainable_numel());
  NamedTensors st = opt.state_tensors();
  EXPECT_EQ(st.size(), 3 * tr.size());  // exp_avg, exp_avg_sq, step per trainable tensor
  for (const auto& [name, t] : st) {
    const std::string pname = name.substr(name.find('/') + 1);
    ASSERT_NE(reg.find(pname), nullptr) << name;
    EXPECT_TRUE(reg.find(pname)->trainable) << name;
  }
  // Frozen weights do not move in a step.
  torch::Tensor frozen_before = reg.find("model.layers.0.mlp.experts.0.up_proj.weight")->tensor.clone();
  torch::Tensor shared_before = reg.find("lm_head.weight")->tensor.clone();
  opt.step(1e-2, 1.0);
  EXPECT_TRUE(torch::equal(frozen_before,
                           reg.find("model.layers.0.mlp.experts.0.up_proj.weight")->tensor));
  EXPECT_FALSE(torch::equal(shared_before, reg.find("lm_head.weight")->tensor));
}

TEST(RegistrySpesNode, ModesAndFrozenExperts) {
  Config cfg = spes_config(4, 2);
  Transformer model(cfg.model);
  Ownership own = Ownership::from_config(cfg);
  // Centralized: everything trains.
  cfg.spes_config.mode = "centralized";
  {
    ParamRegistry reg(model, cfg, own, 0);
    EXPECT_EQ(reg.frozen_numel(), 0);
    EXPECT_EQ(reg.trainable_numel(), model.num_params());
  }
  // SPES node 0 with 1:0 frozen explicitly: layer 0 trains experts 0, 1; layer 1 only 1.
  cfg.spes_config.mode = "spes";
  cfg.frozen_experts = {"1:0"};
  ParamRegistry reg(model, cfg, own, 0);
  for (const auto& e : reg.entries()) {
    if (e.role != ParamRole::Expert) continue;
    const bool expect = e.expert < 2 && !(e.layer == 1 && e.expert == 0);
    EXPECT_EQ(e.trainable, expect) << e.name;
    EXPECT_EQ(e.tensor.requires_grad(), expect) << e.name;
  }
  EXPECT_EQ(reg.frozen_numel(), 5 * 3 * 12 * 16);
}

TEST(RegistryDigest, FingerprintAndWeightsSha) {
  Config cfg = spes_config(4, 2);
  Transformer a(cfg.model), b(cfg.model);
  a.init_weights(1);
  b.init_weights(2);
  Ownership own = Ownership::from_config(cfg);
  ParamRegistry ra(a, cfg, own, 0), rb(b, cfg, own, 1);
  // Same architecture: same fingerprint, whatever the weights and node.
  EXPECT_EQ(ra.fingerprint(), rb.fingerprint());
  EXPECT_EQ(ra.fingerprint(), ParamRegistry(a, cfg, own, 0).fingerprint());
  EXPECT_NE(ra.weights_sha256(), rb.weights_sha256());
  // A different shape changes it.
  for (auto change : {+[](Config& c) { c.model.mlp_hidden_size = 20; },
                      +[](Config& c) { c.model.vocab_size = 40; },
                      +[](Config& c) { c.model.n_kv_heads = 1; },
                      +[](Config& c) { c.model.moe_num_experts = 6; }}) {
    Config c2 = cfg;
    change(c2);
    Transformer m(c2.model);
    c2.spes_config.num_peers = c2.model.moe_num_experts == 6 ? 3 : 2;
    ParamRegistry r(m, c2, Ownership::from_config(c2), 0);
    EXPECT_NE(r.fingerprint(), ra.fingerprint());
  }

  // weights_sha256 = SHA-256 over (name, hex SHA-256 of the fp32 bytes) of every tensor, in
  // registry order; the flat digest of protocols 1-4: SHA-256 over (name, fp32 bytes).
  std::string blob, flat;
  for (const auto& e : ra.entries()) {
    torch::Tensor t = e.tensor.detach().contiguous();
    const std::string bytes(static_cast<const char*>(t.data_ptr()), t.numel() * sizeof(float));
    blob += e.name + sha256_hex(bytes);
    flat += e.name + bytes;
  }
  EXPECT_EQ(ra.weights_sha256(), sha256_hex(blob));
  EXPECT_EQ(ra.weights_sha256().size(), 64u);
  EXPECT_EQ(ra.flat_weights_sha256(), sha256_hex(flat));
  // The thread count does not change it.
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  EXPECT_EQ(ra.weights_sha256(), sha256_hex(blob));
  at::set_num_threads(threads);

  // One changed weight changes the digest; restoring it restores the digest.
  const std::string before = ra.weights_sha256();
  torch::Tensor w = ra.find("model.layers.1.mlp.experts.3.down_proj.weight")->tensor;
  const float old = w[2][5].item<float>();
  {
    torch::NoGradGuard ng;
    w[2][5] = old + 1e-3f;
  }
  EXPECT_NE(ra.weights_sha256(), before);
  {
    torch::NoGradGuard ng;
    w[2][5] = old;
  }
  EXPECT_EQ(ra.weights_sha256(), before);
}
