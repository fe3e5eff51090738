// Scalar quantise / dequantise / rebuild kernels of compressed deltas (see delta_kernels.h).
// Compiled without FP contraction and outside the unity build (CMakeLists.txt); the pragma
// below says the same to GCC in case the file is ever compiled another way.
#pragma GCC optimize("fp-contract=off")
#include "spes/sync/wire/delta_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace spes::sync {

int64_t delta_quantise_int8(const float* d, int64_t n, int8_t* q, float* scales) {
  for (int64_t b = 0; b * kDeltaBlock < n; ++b) {
    const int64_t lo = b * kDeltaBlock, hi = std::min(n, lo + kDeltaBlock);
    float m = 0.0f;
    for (int64_t k = lo; k < hi; ++k) {
      if (!std::isfinite(d[k])) return k;
      m = std::max(m, std::fabs(d[k]));
    }
    const float scale = m / 127.0f;
    scales[b] = scale;
    for (int64_t k = lo; k < hi; ++k) {
      float v = scale > 0.0f ? std::nearbyint(d[k] / scale) : 0.0f;
      v = std::min(127.0f, std::max(-127.0f, v));
      q[k] = static_cast<int8_t>(v);
    }
  }
  return -1;
}

int64_t delta_quantise_bf16(const float* d, int64_t n, uint16_t* q) {
  for (int64_t k = 0; k < n; ++k) {
    if (!std::isfinite(d[k])) return k;
    uint32_t bits;
    std::memcpy(&bits, &d[k], 4);
    bits += 0x7FFFu + ((bits >> 16) & 1u);  // round half to even (finite input)
    q[k] = static_cast<uint16_t>(bits >> 16);
    if ((q[k] & 0x7F80u) == 0x7F80u) return k;  // rounded up to an infinity
  }
  return -1;
}

void delta_rebuild_int8(const float* prev, const int8_t* q, const float* scales, int64_t first,
                        int64_t n, float* out) {
  for (int64_t k = 0; k < n; ++k) {
    const float dq = static_cast<float>(q[k]) * scales[(first + k) / kDeltaBlock];
    out[k] = prev ? prev[k] + dq : dq;
  }
}

void delta_rebuild_bf16(const float* prev, const uint16_t* q, int64_t n, float* out) {
  for (int64_t k = 0; k < n; ++k) {
    const uint32_t bits = static_cast<uint32_t>(q[k]) << 16;
    float dq;
    std::memcpy(&dq, &bits, 4);
    out[k] = prev ? prev[k] + dq : dq;
  }
}

}  // namespace spes::sync
