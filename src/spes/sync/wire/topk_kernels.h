// The arithmetic and byte layout of top-k sparse deltas (spes_config.compression: topk;
// docs/PROTOCOL.md, "Sparse deltas") in plain scalar C++ on raw arrays: per chunk of
// kTopkChunk consecutive values of a flattened tensor, the k largest magnitudes are kept
// (k = topk_chunk_k(density, chunk length)), their values quantised to `bits` bits (a sign and
// bits - 1 bits of magnitude, levels 1..2^(bits-1) times one fp32 scale per chunk), their
// positions coded as a bitmap, as fixed-width positions or as Rice-coded gaps, whichever is
// smallest for the tensor (measured per tensor by the encoder). The decoder checks every byte
// before a value is used and says what is wrong. Compiled like delta_kernels.cpp, on its own
// with -ffp-contract=off (CMakeLists.txt), so prev + deq is the same fp32 on every machine.
// Leaves out: tensors, names, streams and what a sender keeps (topk_codec.h, round/topk_feedback.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace spes::sync {

// Values per chunk (SparseLoCo's chunk size); the last chunk of a tensor may be shorter.
constexpr int64_t kTopkChunk = 4096;
inline int64_t topk_chunks(int64_t n) { return (n + kTopkChunk - 1) / kTopkChunk; }
// The largest per-chunk scale a valid payload may carry: 2^(bits-1) <= 8 times it stays finite.
constexpr float kMaxTopkScale = 3.4028234663852886e38f / 8.0f;
// The payload's format byte (the first byte of every tensor's payload).
constexpr uint8_t kTopkFormat = 1;
// Bytes before the bit stream: format, bits, index coding, Rice parameter, u32 chunks; then
// per chunk a u16 count, then per chunk an f32 scale.
constexpr int64_t kTopkFixedHeader = 8;

// The most entries a chunk of `len` values may carry: ceil(density x len), at least 1, at
// most len (computed in double: the same on every machine for the same density).
int64_t topk_chunk_k(double density, int64_t len);

enum class TopkIndexCoding : uint8_t { Bitmap = 0, Positions = 1, Rice = 2 };
const char* topk_index_coding_name(TopkIndexCoding c);

struct TopkParams {
  double density = 1.0 / 64;
  int bits = 2;  // 2..4
};

// A decoded payload: the sent entries of one tensor, ascending global indices, dequantised.
struct TopkSparse {
  std::vector<int64_t> index;
  std::vector<float> value;
};

// The expected payload bytes of a tensor of n values when every chunk sends its k entries at
// random positions (geometric gaps) with the cheapest index coding for that density: the
// transfer formula of `spes compare` (report/transfer_formula.h). Measured payloads of random
// deltas are within a few percent of it (tests/sync/topk_codec_test.cpp).
uint64_t topk_expected_bytes(int64_t n, const TopkParams& p);

// The most bytes a payload for a tensor of n values can hold and still pass topk_decode (every
// chunk at its k entries in the most expensive index coding): a stream entry longer than this
// is refused from its header, before its bytes are buffered.
uint64_t topk_max_bytes(int64_t n, const TopkParams& p);

// Selects, quantises and codes `v` (n values). `coding` < 0: the smallest index coding for
// this tensor; else that one (for measurements and tests). Writes the payload to *payload and,
// when `deq` is not null, the dense dequantised values (0 where nothing was sent) to deq[0, n).
// Returns the index of the first non-finite value (nothing written), or -1.
int64_t topk_encode(const float* v, int64_t n, const TopkParams& p, std::string* payload,
                    float* deq, int coding = -1);

// Parses and checks a payload for a tensor of n values: format, bits, index coding, chunk
// count, per chunk count <= topk_chunk_k, scale finite in [0, kMaxTopkScale], positions in
// range, strictly ascending (no repeats), a bitmap's population equal to its count, no byte
// missing or left over. Returns "" and fills *out, or the reason it is refused.
std::string topk_decode(const uint8_t* payload, int64_t size, int64_t n, const TopkParams& p,
                        TopkSparse* out);

// out[k] = prev[k] for every k in [first, first + n) of the tensor, plus, at each sent index
// in that range, prev + value (one fp32 add, no FMA). `prev` and `out` hold the values
// [first, first + n) and may alias; prev may be nullptr (then out is deq alone).
void topk_rebuild(const float* prev, const TopkSparse& s, int64_t first, int64_t n, float* out);

}  // namespace spes::sync
