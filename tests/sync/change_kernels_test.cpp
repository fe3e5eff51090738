// The squared-change kernels (sync/round/change_kernels.h) against a plain double-precision
// sum written here, for every input type, lengths that are not multiples of the eight lanes,
// and non-finite values.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "spes/sync/round/change_kernels.h"

namespace spes::sync {
namespace {

template <typename T>
double reference(const std::vector<T>& now, const std::vector<float>& old) {
  long double s = 0;  // wider than the kernel's double: the comparison has room
  for (size_t k = 0; k < now.size(); ++k) {
    const long double x = static_cast<long double>(static_cast<float>(now[k])) - old[k];
    s += x * x;
  }
  return static_cast<double>(s);
}

std::vector<float> random_values(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

TEST(ChangeKernels, SquaredChangeMatchesAPlainSumForEveryType) {
  for (size_t n : {0u, 1u, 7u, 8u, 9u, 1000u, 100003u}) {
    const std::vector<float> old = random_values(n, 1);
    const std::vector<float> f = random_values(n, 2);
    std::vector<c10::BFloat16> b(f.begin(), f.end());
    std::vector<c10::Half> h(f.begin(), f.end());
    const auto tol = [](double want) { return 1e-12 * std::max(1.0, want); };
    const double want_f = reference(f, old), want_b = reference(b, old),
                 want_h = reference(h, old);
    EXPECT_NEAR(squared_change(f.data(), old.data(), static_cast<int64_t>(n)), want_f,
                tol(want_f)) << n;
    EXPECT_NEAR(squared_change(b.data(), old.data(), static_cast<int64_t>(n)), want_b,
                tol(want_b)) << n;
    EXPECT_NEAR(squared_change(h.data(), old.data(), static_cast<int64_t>(n)), want_h,
                tol(want_h)) << n;
    if (n > 0) EXPECT_NE(want_b, want_f) << "bf16 rounding must show in the sum";
  }
}

TEST(ChangeKernels, CopyWithSquaredChangeCopiesAndSums) {
  const size_t n = 12345;
  const std::vector<float> src = random_values(n, 3);
  std::vector<float> dst = random_values(n, 4);
  const double want = reference(src, dst);
  const double got = copy_with_squared_change(src.data(), dst.data(), static_cast<int64_t>(n));
  EXPECT_NEAR(got, want, 1e-12 * want);
  EXPECT_EQ(dst, src);
  EXPECT_EQ(copy_with_squared_change(src.data(), dst.data(), static_cast<int64_t>(n)), 0.0);
}

TEST(ChangeKernels, NonFiniteValuesMakeTheSumNonFinite) {
  // The server's upload check relies on this to find NaN and Inf in one pass.
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()})
    for (size_t at : {0u, 5u, 17u, 20u}) {  // in a full group of eight and in the tail
      std::vector<float> now = random_values(21, 5);
      const std::vector<float> old = random_values(21, 6);
      now[at] = bad;
      EXPECT_FALSE(std::isfinite(squared_change(now.data(), old.data(), 21))) << bad << " " << at;
      std::vector<c10::BFloat16> b(now.begin(), now.end());
      EXPECT_FALSE(std::isfinite(squared_change(b.data(), old.data(), 21))) << bad << " " << at;
    }
}

}  // namespace
}  // namespace spes::sync
