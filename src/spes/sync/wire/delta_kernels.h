// The arithmetic of compressed deltas (docs/PROTOCOL.md, "Compressed deltas") in plain scalar
// C++ on raw arrays: int8 quantisation with one fp32 scale per block of kDeltaBlock values,
// bf16 rounding, and the rebuild P_prev + deq(q) that the server and every node compute and
// must agree on bit for bit. This file is compiled on its own with -ffp-contract=off (see
// CMakeLists.txt): q * scale is rounded to fp32 before it is added, never fused into an FMA,
// and nothing here depends on torch, so the same bits come out on any CPU.
// Leaves out: tensors, names and streams (delta_codec.h).
#pragma once
#include <cstdint>

namespace spes::sync {

// Values per int8 block (a block is kDeltaBlock consecutive values of the flattened tensor;
// the last block of a tensor may be shorter). One fp32 scale per block: 4 bytes per 256
// values, 1.56% on top of the 1 byte per value.
constexpr int64_t kDeltaBlock = 256;
// Blocks of a tensor of n values.
inline int64_t delta_blocks(int64_t n) { return (n + kDeltaBlock - 1) / kDeltaBlock; }
// The largest scale a valid int8 delta can carry: 127 x scale stays a finite fp32.
constexpr float kMaxDeltaScale = 3.4028234663852886e38f / 127.0f;

// int8: per block, scale = max|d| / 127 (0 for an all-zero block) and
// q = round-half-even(d / scale) clamped to [-127, 127] (0 where scale is 0).
// Returns the index of the first non-finite input value, or -1 (then q and scales are set).
int64_t delta_quantise_int8(const float* d, int64_t n, int8_t* q, float* scales);
// bf16: q = d rounded half-to-even to bf16 (raw bf16 bits). Returns the index of the first
// input value that is non-finite or rounds to an infinity, or -1.
int64_t delta_quantise_bf16(const float* d, int64_t n, uint16_t* q);

// out[k] = prev[k] + q[k] * scales[(first + k) / kDeltaBlock] for k in [0, n): the values
// [first, first + n) of a tensor; `scales` are the tensor's scales (block 0 first). `prev` may
// be nullptr (then out is deq(q) alone); `out` may alias `prev`.
void delta_rebuild_int8(const float* prev, const int8_t* q, const float* scales, int64_t first,
                        int64_t n, float* out);
// out[k] = prev[k] + float(q[k]) (bf16 -> fp32 is exact). `prev` may be nullptr.
void delta_rebuild_bf16(const float* prev, const uint16_t* q, int64_t n, float* out);

}  // namespace spes::sync
