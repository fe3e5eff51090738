// AdamW moments in bf16 and 8-bit block-wise form (train/adamw_moments.h): the int8 codes
// decoded by this test's own reading of the documented format, their stochastic rounding
// (within one level, unbiased over seeds), bf16 stochastic rounding; an AdamW step of every
// moment dtype against the update computed here in double from the moments stored before it;
// the checkpoint round trip through real safetensors bytes (same dtype: bit for bit, the next
// step too; across dtypes: converted, fp32 checkpoints of earlier versions included); hostile
// optimizer files refused; the bytes held, measured by the memory meter.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "spes/common/error.h"
#include "spes/io/safetensors.h"
#include "spes/train/adamw_moments.h"
#include "spes/train/memory_meter.h"
#include "spes/train/optimizer.h"
#include "train/train_test_util.h"

using namespace spes;
using spes::test::trainable_entry;
using ::testing::HasSubstr;

namespace {

// The int8 format as documented: value = sign(c) * absmax * 2^((|c| - top) / 8), 0 for code 0;
// top = 127 (int8, signed) or 255 (uint8).
std::vector<double> decode(const torch::Tensor& codes, const torch::Tensor& absmax) {
  const bool is_signed = codes.scalar_type() == torch::kInt8;
  const double top = is_signed ? 127 : 255;
  torch::Tensor c = codes.reshape({-1}).to(torch::kInt64).contiguous();
  torch::Tensor a = absmax.to(torch::kFloat64).contiguous();
  std::vector<double> out(c.numel());
  for (int64_t i = 0; i < c.numel(); ++i) {
    const int64_t k = c.data_ptr<int64_t>()[i];
    const double mag = k == 0 ? 0.0 : std::pow(2.0, (std::abs(k) - top) / 8.0);
    out[i] = (k < 0 ? -1 : 1) * mag * a.data_ptr<double>()[i / kMomentBlock];
  }
  return out;
}

std::vector<double> values(const torch::Tensor& t) {
  torch::Tensor d = t.detach().to(torch::kFloat64).reshape({-1}).contiguous();
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

// Values spanning `octaves` powers of two below 1 (times a random sign when `is_signed`).
torch::Tensor spread_values(int64_t n, double octaves, bool is_signed, uint64_t seed) {
  torch::manual_seed(seed);
  torch::Tensor x = torch::exp2(-torch::rand({n}, torch::kFloat64) * octaves);
  if (is_signed) x = x * torch::sign(torch::rand({n}, torch::kFloat64) - 0.5);
  return x.to(torch::kFloat32);
}

TEST(AdamWMoments, Int8CodesAreWithinOneLevelAndUnbiased) {
  const int64_t n = 4 * kMomentBlock;
  for (bool is_signed : {true, false}) {
    const double octaves = is_signed ? 14 : 30;  // inside each code's range
    const torch::Tensor x = spread_values(n, octaves, is_signed, 7);
    const std::vector<double> want = values(x);
    std::vector<double> sum(n, 0.0);
    const int seeds = 400;
    for (int s = 0; s < seeds; ++s) {
      const torch::Tensor bits =
          moment_rounding_bits(0, n, 1000 + s, torch::kCPU).bitwise_and(0xffff);
      auto [codes, absmax] = quantize_moment(x, bits, is_signed);
      ASSERT_EQ(codes.scalar_type(), is_signed ? torch::kInt8 : torch::kUInt8);
      const std::vector<double> got = decode(codes, absmax);
      const std::vector<double> lib = values(dequantize_moment(codes, absmax));
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_NEAR(lib[i], got[i], 1e-6 * std::abs(got[i])) << i;  // the documented format
        // Between the two levels around the value: same sign, within a factor 2^(1/8).
        ASSERT_GE(got[i] * want[i], 0.0) << i;
        const double ratio = std::abs(got[i] / want[i]);
        ASSERT_GE(ratio, std::pow(2.0, -1.0 / 8) - 1e-6) << i << " " << want[i];
        ASSERT_LE(ratio, std::pow(2.0, 1.0 / 8) + 1e-6) << i << " " << want[i];
        sum[i] += got[i];
      }
    }
    // Unbiased: the mean over seeds converges to the value (one rounding's spread is at most
    // 9% of it; 400 draws leave about 0.45% of it as the mean's standard deviation).
    double worst = 0;
    for (int64_t i = 0; i < n; ++i)
      worst = std::max(worst, std::abs(sum[i] / seeds - want[i]) / std::abs(want[i]));
    EXPECT_LT(worst, 0.025) << (is_signed ? "signed" : "unsigned");
  }
}

TEST(AdamWMoments, Int8KeepsTheAbsmaxZeroAndTinyValuesUnbiased) {
  const double smallest = std::pow(2.0, -126.0 / 8);  // the smallest nonzero level, x absmax
  torch::Tensor x = torch::zeros({2 * kMomentBlock});
  x[0] = -3.0f;                                          // block 0's absmax: exact (code -127)
  x[1] = static_cast<float>(0.3 * smallest * 3.0);       // below it: 0 or the level, mean x
  double mean_tiny = 0;
  const int draws = 4000;
  for (int s = 0; s < draws; ++s) {
    auto [codes, absmax] = quantize_moment(
        x, moment_rounding_bits(0, x.numel(), s, torch::kCPU).bitwise_and(0xffff), true);
    const std::vector<double> d = decode(codes, absmax);
    ASSERT_EQ(d[0], -3.0);
    ASSERT_EQ(codes[0].item<int>(), -127);
    ASSERT_EQ(absmax[1].item<float>(), 0.0f);  // block 1 all zero
    ASSERT_EQ(d[kMomentBlock + 5], 0.0);
    ASSERT_TRUE(d[1] == 0.0 || std::abs(d[1] - smallest * 3.0) < 1e-12) << d[1];
    mean_tiny += d[1] / draws;
  }
  // 0.3 of the level on average (one draw's spread: 0.46 of it; 4000 draws: 0.007).
  EXPECT_NEAR(mean_tiny / (smallest * 3.0), 0.3, 0.03);
}

TEST(AdamWMoments, Bf16StochasticRoundingStaysBetweenNeighboursAndIsUnbiased) {
  const int64_t n = 512;
  const torch::Tensor x = spread_values(n, 20, true, 9) * 1e-3;
  const std::vector<double> want = values(x);
  std::vector<double> sum(n, 0.0);
  for (int s = 0; s < 400; ++s) {
    const torch::Tensor r = round_bf16_stochastic(
        x, moment_rounding_bits(0, n, s, torch::kCPU).bitwise_and(0xffff));
    ASSERT_EQ(r.scalar_type(), torch::kBFloat16);
    const std::vector<double> got = values(r);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_LE(std::abs(got[i] - want[i]), std::abs(want[i]) * std::pow(2.0, -7)) << i;
      sum[i] += got[i] / 400;
    }
  }
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(sum[i], want[i], std::abs(want[i]) * 1e-3) << i;
}

TEST(AdamWMoments, RoundingBitsAreTheSameForAnyChunking) {
  const torch::Tensor all = moment_rounding_bits(0, 1000, 42, torch::kCPU);
  const torch::Tensor part = moment_rounding_bits(300, 200, 42, torch::kCPU);
  EXPECT_TRUE(torch::equal(all.narrow(0, 300, 200), part));
  EXPECT_FALSE(torch::equal(all, moment_rounding_bits(0, 1000, 43, torch::kCPU)));
  EXPECT_GE(all.min().item<int64_t>(), 0);
  EXPECT_LT(all.max().item<int64_t>(), int64_t{1} << 32);
}

OptimizerConfig config_of(MomentDtype dtype) {
  OptimizerConfig c;
  c.moment_dtype = dtype;
  c.learning_rate = 1e-2;
  return c;
}

// Two tensors, one of them not a whole number of int8 blocks.
std::vector<RegistryEntry> make_params(uint64_t seed) {
  torch::manual_seed(seed);
  return {trainable_entry("a", torch::randn({30, 70})), trainable_entry("b", torch::randn({5}))};
}

void set_grads(std::vector<RegistryEntry>& ps, int step) {
  for (size_t i = 0; i < ps.size(); ++i) {
    torch::manual_seed(100 * step + i);
    // Gradients spread over 4 orders of magnitude, as real ones are.
    ps[i].tensor.mutable_grad() =
        torch::randn(ps[i].tensor.sizes()) * torch::exp(torch::randn(ps[i].tensor.sizes()) * 2);
  }
}

// The moments the optimizer holds for tensor `name`, decoded here (int8: this file's decoder).
std::pair<std::vector<double>, std::vector<double>> stored_moments(const AdamW& opt,
                                                                   const std::string& name) {
  std::map<std::string, torch::Tensor> st;
  for (const auto& [n, t] : opt.state_tensors()) st[n] = t;
  const torch::Tensor& m = st.at("exp_avg/" + name);
  const torch::Tensor& v = st.at("exp_avg_sq/" + name);
  if (m.scalar_type() != torch::kInt8) return {values(m), values(v)};
  std::vector<double> md = decode(m, st.at("exp_avg_absmax/" + name));
  const std::vector<double> vd = decode(v, st.at("exp_avg_sq_absmax/" + name));
  for (size_t i = 0; i < md.size(); ++i)
    if (vd[i] == 0) md[i] = 0;  // documented: no second moment, no first
  return {md, vd};
}

TEST(AdamWMoments, StepMatchesTheUpdateComputedFromTheStoredMomentsForEveryDtype) {
  for (MomentDtype dtype : {MomentDtype::Fp32, MomentDtype::Bf16, MomentDtype::Int8}) {
    const OptimizerConfig oc = config_of(dtype);
    auto ps = make_params(1);
    AdamW opt(ps, oc);
    const double b1 = oc.betas[0], b2 = oc.betas[1], lr = oc.learning_rate;
    for (int step = 1; step <= 3; ++step) {
      set_grads(ps, step);
      std::vector<std::vector<double>> p0, g0, m0, v0;
      double sq = 0;
      for (const auto& e : ps) {
        p0.push_back(values(e.tensor));
        g0.push_back(values(e.tensor.grad()));
        auto [m, v] = stored_moments(opt, e.name);
        m0.push_back(m);
        v0.push_back(v);
        for (double g : g0.back()) sq += g * g;
      }
      const double norm = std::sqrt(sq), clip = norm > 1.0 ? 1.0 / (norm + 1e-6) : 1.0;
      EXPECT_NEAR(opt.step(lr, 1.0), norm, 1e-5 * norm);
      const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
      for (size_t t = 0; t < ps.size(); ++t) {
        const std::vector<double> p = values(ps[t].tensor);
        auto [m1, v1] = stored_moments(opt, ps[t].name);
        const size_t n = p.size();
        std::vector<double> m(n), v(n), m_scale(n);
        double m_max = 0, v_max = 0;
        for (size_t i = 0; i < n; ++i) {
          const double g = g0[t][i] * clip;
          m[i] = b1 * m0[t][i] + (1 - b1) * g;
          v[i] = b2 * v0[t][i] + (1 - b2) * g * g;
          m_scale[i] = std::abs(b1 * m0[t][i]) + std::abs((1 - b1) * g);  // before cancelling
          m_max = std::max(m_max, std::abs(m[i]));
          v_max = std::max(v_max, v[i]);
        }
        // What is stored: m and v computed in fp32 (1e-6 of the terms summed), then rounded as
        // the dtype rounds (int8: within one level where the value is inside the code's range;
        // below it, 0 or the smallest level).
        const double tol = dtype == MomentDtype::Fp32 ? 0
                           : dtype == MomentDtype::Bf16 ? std::pow(2.0, -7)
                                                        : std::pow(2.0, 1.0 / 8) - 1 + 1e-6;
        for (size_t i = 0; i < n; ++i) {
          const double upd = lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + oc.eps);
          const double want = p0[t][i] * (1 - lr * oc.weight_decay) - upd;
          ASSERT_NEAR(p[i], want, 2e-6 + 1e-4 * std::abs(upd))
              << Choice<MomentDtype>(dtype).name() << " step " << step << " tensor " << t
              << " value " << i;
          if (v[i] > 1e-8 * v_max) ASSERT_NEAR(v1[i], v[i], (tol + 1e-6) * v[i]) << i;
          if (std::abs(m[i]) > 1e-4 * m_max)
            ASSERT_NEAR(m1[i], m[i], tol * std::abs(m[i]) + 1e-6 * m_scale[i]) << i;
        }
      }
      opt.zero_grad();
    }
  }
}

// The skip flag the GPU's step passes (a 0-d bool on the parameter's device; true after a
// non-finite gradient norm): false updates exactly as no flag does, true leaves the parameter
// and every stored moment as they were. (The same ATen operations run on CUDA; on H100 the
// optimizer once built the flag from a float's bytes, CudaKernels.LowPrecisionMomentsMatchCpu.)
TEST(AdamWMoments, SkipFlagLeavesParameterAndMomentsAsTheyWere) {
  for (MomentDtype dtype : {MomentDtype::Bf16, MomentDtype::Int8}) {
    torch::manual_seed(7);
    const torch::Tensor p0 = torch::randn({300, 70}), g = torch::randn({300, 70});
    const AdamWMoments::Hyper h{1e-2, 0.1, 0.9, 0.95, 1e-8, 0.1, 0.05, 7};
    auto state = [](const AdamWMoments& m) {
      NamedTensors out;
      m.append_state("p", &out);
      for (auto& [n, t] : out) t = t.clone();  // the state itself, not views of it
      return out;
    };
    torch::Tensor pa = p0.clone(), pb = p0.clone(), pc = p0.clone();
    AdamWMoments a(pa, dtype), b(pb, dtype), c(pc, dtype);
    const torch::Tensor one = torch::ones({});
    a.update(pa, g, one, h, torch::Tensor());
    b.update(pb, g, one, h, torch::zeros({}, torch::kBool));
    const NamedTensors before = state(c);
    c.update(pc, g, one, h, torch::ones({}, torch::kBool));
    EXPECT_TRUE(torch::equal(pa, pb)) << Choice<MomentDtype>(dtype).name();
    EXPECT_FALSE(torch::equal(pa, p0));
    EXPECT_TRUE(torch::equal(pc, p0)) << Choice<MomentDtype>(dtype).name();
    const NamedTensors sa = state(a), sb = state(b), sc = state(c);
    for (size_t i = 0; i < sa.size(); ++i) {
      EXPECT_TRUE(torch::equal(sa[i].second, sb[i].second)) << sa[i].first;
      EXPECT_TRUE(torch::equal(sc[i].second, before[i].second)) << sc[i].first;
    }
  }
}

NamedTensors through_bytes(const NamedTensors& t) {
  return safetensors_parse(safetensors_serialize(t), nullptr, "test");
}

TEST(AdamWMoments, CheckpointRoundTripIsBitExactAndConvertsAcrossDtypes) {
  for (MomentDtype dtype : {MomentDtype::Fp32, MomentDtype::Bf16, MomentDtype::Int8}) {
    auto pa = make_params(2), pb = make_params(2);
    AdamW a(pa, config_of(dtype)), b(pb, config_of(dtype));
    for (int s = 1; s <= 2; ++s) {
      set_grads(pa, s);
      a.step(1e-2, 1.0);
      a.zero_grad();
    }
    b.load_state(through_bytes(a.state_tensors()), a.step_count(), "test");
    const NamedTensors sa = a.state_tensors(), sb = b.state_tensors();
    ASSERT_EQ(sa.size(), sb.size());
    for (size_t i = 0; i < sa.size(); ++i) {
      EXPECT_EQ(sa[i].first, sb[i].first);
      EXPECT_TRUE(torch::equal(sa[i].second, sb[i].second)) << sa[i].first;
    }
    EXPECT_EQ(a.state_bytes(), b.state_bytes());
    // The next step of the resumed optimizer is the same, bit for bit.
    for (size_t i = 0; i < pa.size(); ++i) {
      torch::NoGradGuard ng;
      pb[i].tensor.copy_(pa[i].tensor);
    }
    set_grads(pa, 3);
    set_grads(pb, 3);
    a.step(1e-2, 1.0);
    b.step(1e-2, 1.0);
    for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i].tensor, pb[i].tensor));
  }
  // Across dtypes: fp32 moments (every checkpoint before moment_dtype existed) into int8 and
  // bf16, and int8 into fp32: the values, as closely as the target dtype holds them.
  auto p32 = make_params(3);
  AdamW f32(p32, config_of(MomentDtype::Fp32));
  set_grads(p32, 1);
  f32.step(1e-2, 1.0);
  const auto want = stored_moments(f32, "a");
  for (MomentDtype to : {MomentDtype::Int8, MomentDtype::Bf16}) {
    auto pq = make_params(3);
    AdamW q(pq, config_of(to));
    q.load_state(through_bytes(f32.state_tensors()), 1, "test");
    const auto got = stored_moments(q, "a");
    double m_max = 0, v_max = 0;
    for (size_t i = 0; i < want.first.size(); ++i) {
      m_max = std::max(m_max, std::abs(want.first[i]));
      v_max = std::max(v_max, want.second[i]);
    }
    for (size_t i = 0; i < want.first.size(); ++i) {  // inside the codes' range: one level
      if (want.second[i] > 1e-8 * v_max)
        EXPECT_NEAR(got.second[i], want.second[i], 0.1 * want.second[i]) << i;
      if (std::abs(want.first[i]) > 1e-4 * m_max)
        EXPECT_NEAR(got.first[i], want.first[i], 0.1 * std::abs(want.first[i])) << i;
    }
    AdamW back(make_params(3), config_of(MomentDtype::Fp32));
    back.load_state(through_bytes(q.state_tensors()), 1, "test");
    const auto dense = stored_moments(back, "a");
    for (size_t i = 0; i < got.first.size(); ++i) {
      EXPECT_NEAR(dense.first[i], got.first[i], 1e-6 * std::abs(got.first[i]));
      EXPECT_NEAR(dense.second[i], got.second[i], 1e-6 * got.second[i]);
    }
  }
}

TEST(AdamWMoments, HostileInt8StateIsRefusedAndChangesNothing) {
  auto ps = make_params(4);
  AdamW opt(ps, config_of(MomentDtype::Int8));
  set_grads(ps, 1);
  opt.step(1e-2, 1.0);
  const NamedTensors good = opt.state_tensors();
  auto with = [&](const std::string& key, const torch::Tensor& t) {
    NamedTensors s = good;
    for (auto& [n, v] : s)
      if (n == key) v = t;
    return s;
  };
  auto expect_refused = [&](const NamedTensors& s, const std::string& why) {
    const NamedTensors before = opt.state_tensors();
    try {
      opt.load_state(s, 1, "opt.safetensors");
      FAIL() << "accepted: " << why;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr(why));
    }
    const NamedTensors after = opt.state_tensors();
    for (size_t i = 0; i < before.size(); ++i)
      EXPECT_TRUE(torch::equal(before[i].second, after[i].second)) << before[i].first;
  };
  torch::Tensor codes = good[0].second.clone();
  codes[3] = -128;
  expect_refused(with("exp_avg/a", codes), "-128, which is no moment code");
  expect_refused(with("exp_avg_absmax/a", torch::zeros({3})), "must be fp32 [9]");
  expect_refused(with("exp_avg_sq_absmax/a", -torch::ones({9})), "negative or non-finite");
  expect_refused(with("exp_avg_sq/a", torch::zeros({2100}, torch::kFloat32)),
                 "must be int8 and uint8 codes");
  NamedTensors missing;
  for (const auto& [n, t] : good)
    if (n != "exp_avg_sq_absmax/b") missing.emplace_back(n, t);
  expect_refused(missing, "lacks 'exp_avg_sq_absmax/b'");
  // Dense moments that cannot be moments.
  AdamW dense(make_params(4), config_of(MomentDtype::Fp32));
  NamedTensors bad = dense.state_tensors();
  for (auto& [n, t] : bad)
    if (n == "exp_avg_sq/a") t = -torch::ones({30, 70});
  EXPECT_THROW(dense.load_state(bad, 1, "x"), Error);
}

TEST(AdamWMoments, BytesHeldAsMeasuredByTheMemoryMeter) {
  const int64_t numel = 1000 * kMomentBlock + 17;  // one partial block
  for (MomentDtype dtype : {MomentDtype::Fp32, MomentDtype::Bf16, MomentDtype::Int8}) {
    torch::Tensor p = torch::zeros({numel});
    MemoryMeter meter(torch::kCPU);
    const int64_t before = meter.current_bytes();
    AdamW opt({trainable_entry("p", p)}, config_of(dtype));
    EXPECT_EQ(meter.current_bytes() - before, opt.state_bytes());
    EXPECT_EQ(opt.state_bytes(), moment_bytes(numel, dtype));
  }
  EXPECT_EQ(moment_bytes(numel, MomentDtype::Fp32), 8 * numel);
  EXPECT_EQ(moment_bytes(numel, MomentDtype::Bf16), 4 * numel);
  EXPECT_EQ(moment_bytes(numel, MomentDtype::Int8), 2 * numel + 8 * 1001);
}

}  // namespace
