// Transformer parameters: Hugging Face OLMoE names, shapes and roles, num_params against the
// closed-form count from the config, and init_weights (seeded, truncated at +-3 std, std 0.02,
// norm weights 1).
#include <gtest/gtest.h>

#include "model/tiny_model_config.h"

#include <cmath>
#include <map>
#include <set>

#include "spes/model/transformer.h"

using namespace spes;

namespace {

ModelConfig small_config() { return spes::testing::tiny_model_config(); }

std::map<std::string, torch::Tensor> by_name(const Transformer& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.params()) out[p.name] = p.tensor;
  return out;
}

// Parameter count from the config alone.
int64_t expected_params(const ModelConfig& c) {
  const int64_t D = c.d_model, V = c.vocab_size, F = c.ffn_hidden_size(), L = c.n_layers;
  const int64_t hd = D / c.n_heads, kv = (c.n_kv_heads > 0 ? c.n_kv_heads : c.n_heads) * hd;
  int64_t qk = 0;
  if (c.qk_norm == "whole") qk = D + kv;
  if (c.qk_norm == "per_head") qk = 2 * hd;
  const int64_t attn = D * D + 2 * kv * D + D * D + qk + 2 * D;  // q, k, v, o, qk-norm, 2 norms
  const int64_t mlp = c.block_type == "moe" ? c.moe_num_experts * D + c.moe_num_experts * 3 * F * D
                                            : 3 * F * D;
  return V * D + L * (attn + mlp) + D + V * D;
}

}  // namespace

TEST(TransformerParams, HuggingFaceOlmoeNamesAndShapes) {
  ModelConfig c = small_config();
  Transformer m(c);
  auto p = by_name(m);
  const std::map<std::string, std::vector<int64_t>> expected = {
      {"model.embed_tokens.weight", {32, 16}},
      {"model.layers.0.self_attn.q_proj.weight", {16, 16}},
      {"model.layers.0.self_attn.k_proj.weight", {16, 16}},
      {"model.layers.0.self_attn.v_proj.weight", {16, 16}},
      {"model.layers.0.self_attn.o_proj.weight", {16, 16}},
      {"model.layers.1.self_attn.q_norm.weight", {16}},
      {"model.layers.1.self_attn.k_norm.weight", {16}},
      {"model.layers.0.input_layernorm.weight", {16}},
      {"model.layers.1.post_attention_layernorm.weight", {16}},
      {"model.layers.0.mlp.gate.weight", {4, 16}},
      {"model.layers.0.mlp.experts.0.gate_proj.weight", {12, 16}},
      {"model.layers.1.mlp.experts.2.up_proj.weight", {12, 16}},
      {"model.layers.1.mlp.experts.3.down_proj.weight", {16, 12}},
      {"model.norm.weight", {16}},
      {"lm_head.weight", {32, 16}},
  };
  for (const auto& [name, shape] : expected) {
    ASSERT_TRUE(p.count(name)) << "missing " << name;
    EXPECT_EQ(p[name].sizes(), shape) << name;
    EXPECT_EQ(p[name].scalar_type(), torch::kFloat32) << name;
  }
  // 1 embed + per layer (4 attn + 2 qk-norm + 2 norms + router + 4 experts x 3) + norm + head.
  EXPECT_EQ(m.params().size(), 1u + 2u * (4 + 2 + 2 + 1 + 12) + 2u);
  EXPECT_FALSE(p.count("model.layers.2.self_attn.q_proj.weight"));
  EXPECT_FALSE(p.count("model.layers.0.mlp.experts.4.up_proj.weight"));
  EXPECT_EQ(expert_param_name(1, 3, "down_proj"), "model.layers.1.mlp.experts.3.down_proj.weight");

  // Names are unique, roles and (layer, expert) agree with the names.
  std::set<std::string> seen;
  int64_t experts = 0;
  for (const auto& q : m.params()) {
    EXPECT_TRUE(seen.insert(q.name).second) << "duplicate " << q.name;
    const bool is_expert = q.name.find(".mlp.experts.") != std::string::npos;
    EXPECT_EQ(q.role == ParamRole::Expert, is_expert) << q.name;
    if (is_expert) {
      ++experts;
      const std::string proj = q.name.substr(q.name.rfind(".mlp.experts.") + 13);
      const std::string suffix = proj.substr(proj.find('.') + 1);
      EXPECT_EQ(q.name, expert_param_name(q.layer, q.expert, suffix.substr(0, suffix.find('.'))));
    } else {
      EXPECT_EQ(q.layer, -1) << q.name;
      EXPECT_EQ(q.expert, -1) << q.name;
    }
  }
  EXPECT_EQ(experts, 2 * 4 * 3);
  // The accessor returns the head tensor itself.
  EXPECT_TRUE(m.lm_head().is_same(p["lm_head.weight"]));
}

TEST(TransformerParams, NumParamsMatchesFormula) {
  std::vector<ModelConfig> cfgs;
  cfgs.push_back(small_config());
  ModelConfig gqa = small_config();
  gqa.n_heads = 4;
  gqa.n_kv_heads = 2;
  cfgs.push_back(gqa);
  ModelConfig per_head = gqa;
  per_head.qk_norm = "per_head";
  cfgs.push_back(per_head);
  ModelConfig none = small_config();
  none.qk_norm = "none";
  none.moe_num_experts = 6;
  cfgs.push_back(none);
  ModelConfig dense = small_config();
  dense.block_type = "dense";
  cfgs.push_back(dense);
  for (const auto& c : cfgs) {
    Transformer m(c);
    EXPECT_EQ(m.num_params(), expected_params(c))
        << c.qk_norm << " " << c.block_type << " kv=" << c.n_kv_heads;
  }
  // Hand-evaluated for the small config: embed + 2 x (attn + qk-norm + norms + router + experts)
  // + final norm + head.
  EXPECT_EQ(Transformer(small_config()).num_params(), 512 + 2 * (1024 + 32 + 32 + 64 + 2304) + 16 + 512);
}

TEST(TransformerInit, DeterministicPerSeedAndIndependentOfGlobalRng) {
  ModelConfig c = small_config();
  Transformer a(c), b(c), d(c);
  torch::manual_seed(1);
  a.init_weights(42);
  torch::manual_seed(999);
  (void)torch::randn({100});
  b.init_weights(42);
  d.init_weights(43);
  bool any_diff = false;
  for (size_t i = 0; i < a.params().size(); ++i) {
    EXPECT_TRUE(torch::equal(a.params()[i].tensor, b.params()[i].tensor)) << a.params()[i].name;
    if (a.params()[i].tensor.dim() == 2)
      any_diff |= !torch::equal(a.params()[i].tensor, d.params()[i].tensor);
  }
  EXPECT_TRUE(any_diff);
  // Two matrices of the same shape do not get the same values.
  auto p = by_name(a);
  EXPECT_FALSE(torch::equal(p["model.layers.0.self_attn.q_proj.weight"],
                            p["model.layers.0.self_attn.o_proj.weight"]));
  EXPECT_FALSE(torch::equal(p["model.layers.0.mlp.experts.0.gate_proj.weight"],
                            p["model.layers.0.mlp.experts.1.gate_proj.weight"]));
}

TEST(TransformerInit, TruncatedNormalStatistics) {
  ModelConfig c = small_config();
  c.vocab_size = 4096;
  c.d_model = 64;
  c.n_heads = 4;
  c.n_layers = 1;
  Transformer m(c);
  m.init_weights(7);
  const double std = 0.02, cut = 3 * std;
  for (const auto& p : m.params()) {
    if (p.tensor.dim() == 1) {
      EXPECT_TRUE(torch::all(p.tensor == 1.0).item<bool>()) << p.name;
      continue;
    }
    EXPECT_LE(p.tensor.abs().max().item<double>(), cut + 1e-7) << p.name;
    EXPECT_GT(p.tensor.abs().max().item<double>(), 0.0) << p.name;
  }
  // 4096 x 64 = 262144 draws. Standard deviation of N(0, 0.02) truncated at +-3 sigma:
  // 0.02 * sqrt(1 - 2*3*phi(3) / (2*Phi(3) - 1)) = 0.019733; the sampling error is ~3e-5.
  torch::Tensor e = by_name(m)["model.embed_tokens.weight"].to(torch::kFloat64);
  const double phi3 = std::exp(-4.5) / std::sqrt(2 * M_PI);
  const double mass = std::erf(3 / std::sqrt(2.0));
  const double trunc_std = std * std::sqrt(1 - 6 * phi3 / mass);
  EXPECT_NEAR(e.std().item<double>(), trunc_std, 1.5e-4);
  EXPECT_NEAR(e.mean().item<double>(), 0.0, 2e-4);
  // Truncation by resampling: no pile-up of values at the cut (clamping would put ~0.27% there).
  const double at_cut = (e.abs() > cut * 0.999).to(torch::kFloat64).mean().item<double>();
  EXPECT_LT(at_cut, 2e-4);
  // About 4.3% of a 3-sigma truncated normal lies beyond 2 sigma.
  const double beyond2 = (e.abs() > 2 * std).to(torch::kFloat64).mean().item<double>();
  EXPECT_NEAR(beyond2, (std::erf(3 / std::sqrt(2.0)) - std::erf(2 / std::sqrt(2.0))) / mass, 3e-3);
  // init_std / init_cutoff_factor are honoured.
  ModelConfig c2 = small_config();
  c2.init_std = 0.1;
  c2.init_cutoff_factor = 2.0;
  Transformer m2(c2);
  m2.init_weights(1);
  torch::Tensor h = by_name(m2)["lm_head.weight"];
  EXPECT_LE(h.abs().max().item<double>(), 0.2 + 1e-7);
  EXPECT_GT(h.abs().max().item<double>(), 0.15);
}

TEST(TransformerForward, ShapesAndRouterStats) {
  ModelConfig c = small_config();
  Transformer m(c);
  m.init_weights(3);
  torch::Tensor tokens = torch::randint(0, 32, {3, 8}, torch::kInt64);
  ForwardResult r = m.forward(tokens);
  EXPECT_EQ(r.hidden.sizes(), (std::vector<int64_t>{3, 8, 16}));
  ASSERT_EQ(r.routers.size(), 2u);
  for (const auto& s : r.routers) {
    EXPECT_EQ(s.probs.sizes(), (std::vector<int64_t>{24, 4}));
    EXPECT_EQ(s.counts.sum().item<double>(), 24.0 * 2);
  }
  // Final RMSNorm with unit weight: every hidden vector has mean square ms/(ms + eps) <= 1,
  // close to 1 (the residual stream of this small-init model has rms ~0.02, so ms ~ 4e-4).
  torch::Tensor ms = r.hidden.pow(2).mean(-1);
  EXPECT_LE(ms.max().item<double>(), 1.0 + 1e-5);
  EXPECT_GT(ms.min().item<double>(), 0.95);
  EXPECT_EQ(m.logits(tokens).sizes(), (std::vector<int64_t>{3, 8, 32}));
  // Causal: changing the last token leaves the logits of earlier positions unchanged.
  torch::Tensor t2 = tokens.clone();
  t2.select(1, 7).add_(1).remainder_(32);
  EXPECT_TRUE(torch::allclose(m.logits(tokens).narrow(1, 0, 7), m.logits(t2).narrow(1, 0, 7),
                              1e-6, 1e-6));
  EXPECT_THROW(m.forward(torch::zeros({1, 9}, torch::kInt64)), std::exception);
}
