// The fused CPU kernels (RMSNorm, SwiGLU expert, block-causal attention with RoPE, LM head +
// cross-entropy + z-loss) against independent computations: the composite reference
// implementations (plain ATen ops, autograd through them) for values and gradients in fp32,
// and central finite differences in fp64 for the gradients of the kernels themselves.
#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "spes/model/layers.h"
#include "spes/model/losses.h"

using namespace spes;

namespace {

using Fn = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;

double maxrel(const torch::Tensor& a, const torch::Tensor& b) {
  torch::Tensor x = a.to(torch::kFloat64), y = b.to(torch::kFloat64);
  return ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item<double>();
}

// Gradients of sum(f(inputs) * probe) with respect to each input (autograd).
std::vector<torch::Tensor> grads_of(const Fn& f, std::vector<torch::Tensor> inputs,
                                    const torch::Tensor& probe) {
  for (auto& t : inputs) t = t.detach().clone().requires_grad_(true);
  (f(inputs) * probe).sum().backward();
  std::vector<torch::Tensor> g;
  for (auto& t : inputs) g.push_back(t.grad().defined() ? t.grad() : torch::zeros_like(t));
  return g;
}

// Central finite differences of sum(f(inputs) * probe) in fp64 for up to `per_input` entries
// of each input, compared with autograd's gradient.
void check_finite_differences(const Fn& f, const std::vector<torch::Tensor>& inputs,
                              int64_t per_input = 40, double tol = 1e-6) {
  torch::NoGradGuard outer;
  std::vector<torch::Tensor> x;
  for (const auto& t : inputs) x.push_back(t.to(torch::kFloat64).contiguous());
  torch::Tensor probe;
  {
    torch::AutoGradMode on(true);
    probe = torch::randn(f(x).sizes(), torch::kFloat64);
  }
  std::vector<torch::Tensor> g;
  {
    torch::AutoGradMode on(true);
    g = grads_of(f, x, probe);
  }
  const double h = 1e-6;
  for (size_t i = 0; i < x.size(); ++i) {
    const int64_t n = x[i].numel();
    const int64_t step = std::max<int64_t>(1, n / per_input);
    for (int64_t j = 0; j < n; j += step) {
      auto xp = x, xm = x;
      xp[i] = x[i].clone();
      xm[i] = x[i].clone();
      xp[i].view(-1)[j] += h;
      xm[i].view(-1)[j] -= h;
      const double fd = ((f(xp) - f(xm)) * probe).sum().item<double>() / (2 * h);
      const double an = g[i].reshape(-1)[j].item<double>();
      EXPECT_NEAR(an, fd, tol * std::max(1.0, std::abs(fd))) << "input " << i << " entry " << j;
    }
  }
}

// Values and gradients of `fused` against `reference` in fp32.
void check_against_reference(const Fn& fused, const Fn& reference,
                             const std::vector<torch::Tensor>& inputs, double tol = 2e-5) {
  torch::Tensor yf, yr;
  {
    torch::NoGradGuard ng;
    yf = fused(inputs);
    yr = reference(inputs);
  }
  ASSERT_EQ(yf.sizes(), yr.sizes());
  EXPECT_LT(maxrel(yf, yr), tol) << "forward";
  torch::Tensor probe = torch::randn(yf.sizes());
  auto gf = grads_of(fused, inputs, probe);
  auto gr = grads_of(reference, inputs, probe);
  for (size_t i = 0; i < gf.size(); ++i) EXPECT_LT(maxrel(gf[i], gr[i]), tol) << "grad " << i;
}

}  // namespace

TEST(FusedRmsNorm, MatchesReferenceAndFiniteDifferences) {
  torch::manual_seed(1);
  const double eps = 1e-6;
  Fn fused = [&](const std::vector<torch::Tensor>& t) { return rms_norm(t[0], t[1], eps); };
  Fn ref = [&](const std::vector<torch::Tensor>& t) {
    return rms_norm_reference(t[0], t[1], eps);
  };
  // 3-D input with more rows than one block (weight gradient summed over blocks).
  check_against_reference(fused, ref, {torch::randn({3, 50, 24}), torch::rand({24}) + 0.5});
  check_finite_differences(fused, {torch::randn({5, 7}), torch::rand({7}) + 0.5});
  // Frozen weight: only the input gradient.
  torch::Tensor x = torch::randn({4, 8}, torch::requires_grad()), w = torch::rand({8});
  rms_norm(x, w, eps).sum().backward();
  EXPECT_TRUE(x.grad().defined());
}

TEST(FusedSwiGLU, MatchesReferenceAndFiniteDifferences) {
  torch::manual_seed(2);
  auto as_expert = [](const std::vector<torch::Tensor>& t) {
    return ExpertWeights{t[1], t[2], t[3]};
  };
  Fn fused = [&](const std::vector<torch::Tensor>& t) {
    return expert_forward(as_expert(t), t[0]);
  };
  Fn ref = [&](const std::vector<torch::Tensor>& t) {
    return expert_forward_reference(as_expert(t), t[0]);
  };
  check_against_reference(fused, ref,
                          {torch::randn({37, 16}), torch::randn({24, 16}) * 0.3,
                           torch::randn({24, 16}) * 0.3, torch::randn({16, 24}) * 0.3});
  check_finite_differences(fused, {torch::randn({6, 5}), torch::randn({7, 5}),
                                   torch::randn({7, 5}), torch::randn({5, 7})});
  // A frozen expert passes the input gradient (equal to the reference's) and leaves its
  // weights without gradients.
  ExpertWeights e{torch::randn({12, 8}), torch::randn({12, 8}), torch::randn({8, 12})};
  torch::Tensor x1 = torch::randn({9, 8}, torch::requires_grad());
  torch::Tensor x2 = x1.detach().clone().requires_grad_(true);
  expert_forward(e, x1).pow(2).sum().backward();
  expert_forward_reference(e, x2).pow(2).sum().backward();
  EXPECT_LT(maxrel(x1.grad(), x2.grad()), 2e-5);
  EXPECT_FALSE(e.w1.grad().defined());
}

TEST(FusedAttention, MatchesReferenceAndFiniteDifferences) {
  torch::manual_seed(3);
  // T = 150: three query blocks, the last one partial. hd = 8.
  const int64_t B = 2, H = 2, T = 150, hd = 8;
  auto [cos, sin] = rope_tables(T, hd, 10000.0, torch::kCPU);
  Fn fused = [&](const std::vector<torch::Tensor>& t) {
    return fused_causal_attention(t[0], t[1], t[2], cos, sin, true);
  };
  Fn ref = [&](const std::vector<torch::Tensor>& t) {
    return causal_attention_reference(rope_apply(t[0], cos, sin), rope_apply(t[1], cos, sin),
                                      t[2]);
  };
  // q and k as transposed views of [B, T, H, hd] (as the attention sub-layer passes them).
  auto bthd = [&](int64_t heads) { return torch::randn({B, T, heads, hd}).transpose(1, 2); };
  check_against_reference(fused, ref, {bthd(H), bthd(H), bthd(H)});
  // GQA: 4 query heads read 2 kv heads.
  check_against_reference(fused, ref, {torch::randn({1, 4, 70, hd}), torch::randn({1, 2, 70, hd}),
                                       torch::randn({1, 2, 70, hd})});
  // Without RoPE (causal_attention).
  Fn plain = [&](const std::vector<torch::Tensor>& t) { return causal_attention(t[0], t[1], t[2]); };
  Fn plain_ref = [&](const std::vector<torch::Tensor>& t) {
    return causal_attention_reference(t[0], t[1], t[2]);
  };
  check_against_reference(plain, plain_ref, {bthd(H), bthd(H), bthd(H)});
  // Finite differences in fp64 across a block boundary (T = 67, blocks of 64).
  auto [c2, s2] = rope_tables(67, 4, 10000.0, torch::kCPU);
  Fn fused2 = [&](const std::vector<torch::Tensor>& t) {
    return fused_causal_attention(t[0], t[1], t[2], c2, s2, true);
  };
  check_finite_differences(fused2, {torch::randn({1, 2, 67, 4}), torch::randn({1, 2, 67, 4}),
                                    torch::randn({1, 2, 67, 4})}, 60);
}

TEST(FusedLmHeadLosses, MatchesReferenceAndFiniteDifferences) {
  torch::manual_seed(4);
  torch::Tensor targets = torch::randint(0, 29, {23}, torch::kInt64);
  targets[3] = -1;  // ignored positions
  targets[10] = -1;
  // Both terms with weights, as compute_losses combines them.
  auto combine = [](std::pair<torch::Tensor, torch::Tensor> r) {
    return torch::stack({r.first, r.second * 0.37});
  };
  Fn fused = [&](const std::vector<torch::Tensor>& t) {
    return combine(lm_head_losses(t[0], t[1], targets));
  };
  Fn ref = [&](const std::vector<torch::Tensor>& t) {
    return combine(lm_losses(torch::matmul(t[0], t[1].t()), targets));
  };
  check_against_reference(fused, ref, {torch::randn({23, 16}), torch::randn({29, 16})});
  check_finite_differences(fused, {torch::randn({23, 6}), torch::randn({29, 6})}, 60);
  // Only the cross-entropy used (the z-loss output gets no gradient).
  torch::Tensor h = torch::randn({23, 16}, torch::requires_grad());
  torch::Tensor w = torch::randn({29, 16});
  torch::Tensor h2 = h.detach().clone().requires_grad_(true);
  lm_head_losses(h, w, targets).first.backward();
  lm_losses(torch::matmul(h2, w.t()), targets).first.backward();
  EXPECT_LT(maxrel(h.grad(), h2.grad()), 2e-5);
}
