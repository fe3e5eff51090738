// Sums of squared changes (see change_kernels.h).
#include "spes/sync/round/change_kernels.h"

#include <cstring>

namespace spes::sync {
namespace {

constexpr int64_t kLanes = 8;

// Lane j sums the values k = j (mod 8) of each full group of eight; the tail goes to lane 0.
// With kCopy the new values are then written to `dst` (which is `old`).
template <typename T, bool kCopy>
double lanes_sum(const T* now, const float* old, float* dst, int64_t n) {
  double acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    float v[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) v[j] = static_cast<float>(now[k + j]);
    for (int64_t j = 0; j < kLanes; ++j) {
      const double x = static_cast<double>(v[j]) - static_cast<double>(old[k + j]);
      acc[j] += x * x;
    }
    if constexpr (kCopy) std::memcpy(dst + k, v, sizeof(v));
  }
  for (; k < n; ++k) {
    const float v = static_cast<float>(now[k]);
    const double x = static_cast<double>(v) - static_cast<double>(old[k]);
    acc[0] += x * x;
    if constexpr (kCopy) dst[k] = v;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

}  // namespace

double squared_change(const float* now, const float* old, int64_t n) {
  return lanes_sum<float, false>(now, old, nullptr, n);
}
double squared_change(const c10::BFloat16* now, const float* old, int64_t n) {
  return lanes_sum<c10::BFloat16, false>(now, old, nullptr, n);
}
double squared_change(const c10::Half* now, const float* old, int64_t n) {
  return lanes_sum<c10::Half, false>(now, old, nullptr, n);
}
double copy_with_squared_change(const float* src, float* dst, int64_t n) {
  return lanes_sum<float, true>(src, dst, dst, n);
}

}  // namespace spes::sync
