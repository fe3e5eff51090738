// RoPE tables and rotation against hand-computed values, causal attention (causality, explicit
// double softmax reference, GQA head grouping), RMSNorm by hand, and the attention sub-layer
// (whole / per-head / no QK-norm) against an independent double-precision reference.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "spes/model/layers.h"
#include "spes/model/transformer.h"

using namespace spes;

namespace {

double maxdiff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

// Explicit causal softmax attention in double, one (b, h, i) at a time; head h reads kv head
// h / (H / Hkv) (the grouping of Hugging Face repeat_kv).
torch::Tensor reference_attention(const torch::Tensor& q_, const torch::Tensor& k_,
                                  const torch::Tensor& v_) {
  torch::Tensor q = q_.to(torch::kFloat64).contiguous(), k = k_.to(torch::kFloat64).contiguous(),
                v = v_.to(torch::kFloat64).contiguous();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), hd = q.size(3), Hkv = k.size(1);
  auto qa = q.accessor<double, 4>(), ka = k.accessor<double, 4>(), va = v.accessor<double, 4>();
  torch::Tensor out = torch::zeros({B, H, T, hd}, torch::kFloat64);
  auto oa = out.accessor<double, 4>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / Hkv);
      for (int64_t i = 0; i < T; ++i) {
        std::vector<double> s(i + 1);
        double mx = -1e300;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < hd; ++d) dot += qa[b][h][i][d] * ka[b][g][j][d];
          s[j] = dot / std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, s[j]);
        }
        double z = 0;
        for (auto& x : s) z += (x = std::exp(x - mx));
        for (int64_t j = 0; j <= i; ++j)
          for (int64_t d = 0; d < hd; ++d) oa[b][h][i][d] += s[j] / z * va[b][g][j][d];
      }
    }
  return out;
}

// RMSNorm over the last dim, by hand, in double.
torch::Tensor reference_rms(const torch::Tensor& x_, const torch::Tensor& w_, double eps) {
  torch::Tensor x = x_.to(torch::kFloat64).contiguous();
  torch::Tensor w = w_.to(torch::kFloat64).contiguous();
  const int64_t n = x.size(-1), rows = x.numel() / n;
  torch::Tensor out = torch::empty_like(x);
  const double* xp = x.data_ptr<double>();
  const double* wp = w.data_ptr<double>();
  double* op = out.data_ptr<double>();
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += xp[r * n + i] * xp[r * n + i];
    const double inv = 1.0 / std::sqrt(ss / n + eps);
    for (int64_t i = 0; i < n; ++i) op[r * n + i] = xp[r * n + i] * inv * wp[i];
  }
  return out;
}

// Rotate-half RoPE in double with inv_freq_i = theta^(-2i/hd), on x [B, H, T, hd].
torch::Tensor reference_rope(const torch::Tensor& x_, double theta) {
  torch::Tensor x = x_.to(torch::kFloat64).contiguous();
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), hd = x.size(3), half = hd / 2;
  torch::Tensor out = torch::empty_like(x);
  auto xa = x.accessor<double, 4>();
  auto oa = out.accessor<double, 4>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < half; ++i) {
          const double ang = t * std::pow(theta, -2.0 * i / hd);
          const double x1 = xa[b][h][t][i], x2 = xa[b][h][t][i + half];
          oa[b][h][t][i] = x1 * std::cos(ang) - x2 * std::sin(ang);
          oa[b][h][t][i + half] = x2 * std::cos(ang) + x1 * std::sin(ang);
        }
  return out;
}

}  // namespace

TEST(RopeNumeric, TablesMatchHandValues) {
  auto [cos, sin] = rope_tables(3, 4, 10000.0, torch::kCPU);
  ASSERT_EQ(cos.sizes(), (std::vector<int64_t>{3, 4}));
  ASSERT_EQ(sin.sizes(), (std::vector<int64_t>{3, 4}));
  // inv_freq = [10000^0, 10000^(-2/4)] = [1, 0.01]; halves duplicated.
  const double f[4] = {1.0, 0.01, 1.0, 0.01};
  for (int t = 0; t < 3; ++t)
    for (int i = 0; i < 4; ++i) {
      EXPECT_NEAR(cos[t][i].item<double>(), std::cos(t * f[i]), 1e-7) << t << "," << i;
      EXPECT_NEAR(sin[t][i].item<double>(), std::sin(t * f[i]), 1e-7) << t << "," << i;
    }
}

TEST(RopeNumeric, RotateHalfMatchesHandValues) {
  auto [cos, sin] = rope_tables(3, 4, 10000.0, torch::kCPU);
  // x = [1, 2, 3, 4] at every position: x1 = [1, 2], x2 = [3, 4], rotated = [-3, -4, 1, 2].
  torch::Tensor x = torch::tensor({1.0f, 2.0f, 3.0f, 4.0f}).repeat({1, 1, 3, 1});
  torch::Tensor y = rope_apply(x, cos, sin);
  ASSERT_EQ(y.sizes(), x.sizes());
  for (int t = 0; t < 3; ++t) {
    const double c0 = std::cos(t * 1.0), s0 = std::sin(t * 1.0);
    const double c1 = std::cos(t * 0.01), s1 = std::sin(t * 0.01);
    const double expect[4] = {1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0,
                              4 * c1 + 2 * s1};
    for (int i = 0; i < 4; ++i)
      EXPECT_NEAR(y[0][0][t][i].item<double>(), expect[i], 1e-6) << "t=" << t << " i=" << i;
  }
  // Position 0 is the identity.
  EXPECT_LT(maxdiff(y.select(2, 0), x.select(2, 0)), 1e-7);
}

TEST(RopeNumeric, LargerCaseAndRelativePosition) {
  torch::manual_seed(1);
  const double theta = 500000.0;
  torch::Tensor x = torch::randn({2, 3, 7, 8});
  auto [cos, sin] = rope_tables(16, 8, theta, torch::kCPU);
  EXPECT_LT(maxdiff(rope_apply(x, cos, sin), reference_rope(x, theta)), 1e-5);
  // <rope(q, m), rope(k, n)> depends on m - n only.
  torch::Tensor q = torch::randn({8}), k = torch::randn({8});
  auto at = [&](const torch::Tensor& v, int64_t pos) {
    torch::Tensor seq = torch::zeros({1, 1, pos + 1, 8});
    seq[0][0][pos] = v;
    return rope_apply(seq, cos, sin)[0][0][pos];
  };
  const double d1 = (at(q, 5) * at(k, 2)).sum().item<double>();
  const double d2 = (at(q, 11) * at(k, 8)).sum().item<double>();
  EXPECT_NEAR(d1, d2, 1e-5);
}

TEST(CausalAttentionNumeric, MatchesDoubleReference) {
  torch::manual_seed(2);
  torch::Tensor q = torch::randn({2, 3, 6, 4}), k = torch::randn({2, 3, 6, 4}),
                v = torch::randn({2, 3, 6, 4});
  torch::Tensor y = causal_attention(q, k, v);
  ASSERT_EQ(y.sizes(), q.sizes());
  EXPECT_LT(maxdiff(y, reference_attention(q, k, v)), 1e-5);
  // First position attends to itself only.
  EXPECT_LT(maxdiff(y.select(2, 0), v.select(2, 0)), 1e-6);
}

TEST(CausalAttentionNumeric, FutureTokensDoNotChangeThePast) {
  torch::manual_seed(3);
  const int64_t T = 7;
  torch::Tensor q = torch::randn({1, 2, T, 4}), k = torch::randn({1, 2, T, 4}),
                v = torch::randn({1, 2, T, 4});
  torch::Tensor y = causal_attention(q, k, v);
  for (int64_t t = 0; t + 1 < T; ++t) {
    torch::Tensor q2 = q.clone(), k2 = k.clone(), v2 = v.clone();
    for (auto* s : {&q2, &k2, &v2}) s->narrow(2, t + 1, T - t - 1).normal_(0.0, 5.0);
    torch::Tensor y2 = causal_attention(q2, k2, v2);
    EXPECT_LT(maxdiff(y.narrow(2, 0, t + 1), y2.narrow(2, 0, t + 1)), 1e-7) << "t=" << t;
    EXPECT_GT(maxdiff(y.narrow(2, t + 1, T - t - 1), y2.narrow(2, t + 1, T - t - 1)), 1e-3);
  }
}

TEST(CausalAttentionNumeric, GqaEqualsRepeatedKvHeads) {
  torch::manual_seed(4);
  const int64_t H = 4, Hkv = 2;
  torch::Tensor q = torch::randn({2, H, 5, 4}), k = torch::randn({2, Hkv, 5, 4}),
                v = torch::randn({2, Hkv, 5, 4});
  torch::Tensor y = causal_attention(q, k, v);
  // Heads 0,1 read kv head 0; heads 2,3 read kv head 1.
  torch::Tensor kr = torch::stack({k.select(1, 0), k.select(1, 0), k.select(1, 1), k.select(1, 1)}, 1);
  torch::Tensor vr = torch::stack({v.select(1, 0), v.select(1, 0), v.select(1, 1), v.select(1, 1)}, 1);
  EXPECT_LT(maxdiff(y, causal_attention(q, kr, vr)), 1e-6);
  EXPECT_LT(maxdiff(y, reference_attention(q, k, v)), 1e-5);
}

// LIBRARY BUG (reported): the libtorch-1.x path of attention.cpp computes the softmax with
// dtype kFloat32 and casts back, so double inputs lose precision (~1e-7). Fix: softmax in
// at::promote_types(q.scalar_type(), kFloat32).
TEST(CausalAttentionNumeric, DoubleInputsAreComputedInDouble) {
  torch::manual_seed(5);
  auto o = torch::TensorOptions().dtype(torch::kFloat64);
  torch::Tensor q = torch::randn({1, 2, 5, 4}, o), k = torch::randn({1, 2, 5, 4}, o),
                v = torch::randn({1, 2, 5, 4}, o);
  torch::Tensor y = causal_attention(q, k, v);
  EXPECT_EQ(y.scalar_type(), torch::kFloat64);
  EXPECT_LT(maxdiff(y, reference_attention(q, k, v)), 1e-12);
}

TEST(RmsNormNumeric, MatchesHandComputation) {
  // Row [1, 2, 3, 4]: mean square 7.5; row [-2, 0, 0, 2]: mean square 2.
  torch::Tensor x = torch::tensor({1.0f, 2.0f, 3.0f, 4.0f, -2.0f, 0.0f, 0.0f, 2.0f}).view({2, 4});
  torch::Tensor w = torch::tensor({1.0f, 0.5f, 2.0f, -1.0f});
  torch::Tensor y = rms_norm(x, w, 1e-6);
  const double r0 = 1.0 / std::sqrt(7.5 + 1e-6), r1 = 1.0 / std::sqrt(2.0 + 1e-6);
  const double expect[2][4] = {{1 * r0 * 1, 2 * r0 * 0.5, 3 * r0 * 2, 4 * r0 * -1},
                               {-2 * r1 * 1, 0, 0, 2 * r1 * -1}};
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) EXPECT_NEAR(y[i][j].item<double>(), expect[i][j], 1e-6);
  // eps matters for a zero row: output 0, not NaN.
  torch::Tensor z = rms_norm(torch::zeros({1, 4}), w, 1e-6);
  EXPECT_TRUE(torch::isfinite(z).all().item<bool>());
  // bf16 in, bf16 out, computed in fp32.
  torch::manual_seed(6);
  torch::Tensor xb = torch::randn({3, 16}).to(torch::kBFloat16);
  torch::Tensor wb = torch::rand({16}).to(torch::kBFloat16);
  torch::Tensor yb = rms_norm(xb, wb, 1e-6);
  EXPECT_EQ(yb.scalar_type(), torch::kBFloat16);
  EXPECT_LT(maxdiff(yb, reference_rms(xb, wb, 1e-6)), 2e-2);
}

// LIBRARY BUG (reported): rms_norm (norm_rope.cpp) always computes in fp32, so a double input
// comes back with fp32 rounding. Fix: compute in at::promote_types(x.scalar_type(), kFloat32).
TEST(RmsNormNumeric, DoubleInputsAreComputedInDouble) {
  torch::manual_seed(7);
  torch::Tensor x = torch::randn({4, 10}, torch::kFloat64);
  torch::Tensor w = torch::randn({10}, torch::kFloat64);
  torch::Tensor y = rms_norm(x, w, 1e-6);
  EXPECT_EQ(y.scalar_type(), torch::kFloat64);
  EXPECT_LT(maxdiff(y, reference_rms(x, w, 1e-6)), 1e-13);
}

// The attention sub-layer for every QK-norm mode (and GQA) against an independent reference:
// projections, RMSNorm over D (whole) or head_dim (per_head), rotate-half RoPE, causal softmax,
// output projection.
TEST(AttentionForwardNumeric, QkNormModesMatchReference) {
  for (const std::string mode : {"whole", "per_head", "none"})
    for (int64_t kvh : {0, 1}) {
      SCOPED_TRACE(mode + " n_kv_heads=" + std::to_string(kvh));
      ModelConfig cfg;
      cfg.d_model = 16;
      cfg.n_heads = 2;
      cfg.n_kv_heads = kvh;
      cfg.qk_norm = mode;
      cfg.rope_theta = 10000.0;
      cfg.max_sequence_length = 8;
      const int64_t D = 16, hd = 8, Hkv = cfg.kv_heads(), kv = Hkv * hd, B = 2, T = 5;
      torch::manual_seed(8 + kvh);
      BlockWeights b;
      b.q = torch::randn({D, D}) * 0.3;
      b.k = torch::randn({kv, D}) * 0.3;
      b.v = torch::randn({kv, D}) * 0.3;
      b.o = torch::randn({D, D}) * 0.3;
      if (mode == "whole") {
        b.q_norm = torch::rand({D}) + 0.5;
        b.k_norm = torch::rand({kv}) + 0.5;
      } else if (mode == "per_head") {
        b.q_norm = torch::rand({hd}) + 0.5;
        b.k_norm = torch::rand({hd}) + 0.5;
      }
      torch::Tensor x = torch::randn({B, T, D});
      auto [cos, sin] = rope_tables(8, hd, cfg.rope_theta, torch::kCPU);
      torch::Tensor y = attention_forward(b, x, cfg, cos, sin);
      ASSERT_EQ(y.sizes(), (std::vector<int64_t>{B, T, D}));

      // Reference in double.
      auto d = [](const torch::Tensor& t) { return t.to(torch::kFloat64); };
      torch::Tensor q = torch::matmul(d(x), d(b.q).t()), k = torch::matmul(d(x), d(b.k).t()),
                    v = torch::matmul(d(x), d(b.v).t());
      if (mode == "whole") {
        q = reference_rms(q, b.q_norm, 1e-6);
        k = reference_rms(k, b.k_norm, 1e-6);
      }
      q = q.view({B, T, 2, hd});
      k = k.view({B, T, Hkv, hd});
      if (mode == "per_head") {
        q = reference_rms(q, b.q_norm, 1e-6);
        k = reference_rms(k, b.k_norm, 1e-6);
      }
      q = reference_rope(q.transpose(1, 2), 10000.0);
      k = reference_rope(k.transpose(1, 2), 10000.0);
      v = v.view({B, T, Hkv, hd}).transpose(1, 2);
      torch::Tensor a = reference_attention(q, k, v).transpose(1, 2).reshape({B, T, D});
      torch::Tensor ref = torch::matmul(a, d(b.o).t());
      EXPECT_LT(maxdiff(y, ref), 1e-4);
    }
}

// The model allocates q_norm/k_norm over D (whole) or head_dim (per_head), none when disabled.
TEST(AttentionForwardNumeric, QkNormParameterShapes) {
  for (const std::string mode : {"whole", "per_head", "none"}) {
    ModelConfig cfg;
    cfg.d_model = 16;
    cfg.n_heads = 4;
    cfg.n_kv_heads = 2;
    cfg.n_layers = 1;
    cfg.moe_num_experts = 2;
    cfg.moe_top_k = 1;
    cfg.mlp_hidden_size = 16;
    cfg.vocab_size = 16;
    cfg.max_sequence_length = 8;
    cfg.qk_norm = mode;
    Transformer m(cfg);
    m.init_weights(1);
    const torch::Tensor* qn = nullptr;
    const torch::Tensor* kn = nullptr;
    for (const auto& p : m.params()) {
      if (p.name == "model.layers.0.self_attn.q_norm.weight") qn = &p.tensor;
      if (p.name == "model.layers.0.self_attn.k_norm.weight") kn = &p.tensor;
    }
    if (mode == "none") {
      EXPECT_EQ(qn, nullptr);
      EXPECT_EQ(kn, nullptr);
    } else {
      ASSERT_NE(qn, nullptr);
      ASSERT_NE(kn, nullptr);
      EXPECT_EQ(qn->sizes(), (std::vector<int64_t>{mode == "whole" ? 16 : 4}));
      EXPECT_EQ(kn->sizes(), (std::vector<int64_t>{mode == "whole" ? 8 : 4}));
    }
    torch::Tensor logits = m.logits(torch::randint(0, 16, {2, 6}));
    EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 6, 16}));
    EXPECT_TRUE(torch::isfinite(logits).all().item<bool>());
  }
}
