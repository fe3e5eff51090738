// Scalar selection, quantisation, coding, checked decoding and rebuild of top-k sparse deltas
// (see topk_kernels.h). Compiled without FP contraction and outside the unity build
// (CMakeLists.txt); the pragma says the same to GCC in case the file is compiled another way.
#pragma GCC optimize("fp-contract=off")
#include "spes/sync/wire/topk_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

namespace spes::sync {
namespace {

// Bits are written and read least significant first, bytes in order.
class BitWriter {
 public:
  explicit BitWriter(std::string* out) : out_(out) {}
  void put(uint64_t v, int nbits) {
    for (int b = 0; b < nbits; ++b) {
      if (fill_ == 0) out_->push_back('\0');
      if ((v >> b) & 1u) out_->back() = static_cast<char>(out_->back() | (1u << fill_));
      fill_ = (fill_ + 1) & 7;
    }
  }

 private:
  std::string* out_;
  int fill_ = 0;  // bits used in the last byte (0: a new byte is needed)
};

class BitReader {
 public:
  BitReader(const uint8_t* p, int64_t bytes) : p_(p), bits_(bytes * 8) {}
  bool get(int nbits, uint64_t* v) {
    if (nbits > bits_ - pos_) return false;
    uint64_t r = 0;
    for (int b = 0; b < nbits; ++b, ++pos_)
      r |= static_cast<uint64_t>((p_[pos_ >> 3] >> (pos_ & 7)) & 1u) << b;
    *v = r;
    return true;
  }
  int64_t pos() const { return pos_; }
  int64_t size_bits() const { return bits_; }
  // True when every bit from pos() to the end is zero (the last byte's padding).
  bool rest_zero() const {
    for (int64_t k = pos_; k < bits_; ++k)
      if ((p_[k >> 3] >> (k & 7)) & 1u) return false;
    return true;
  }

 private:
  const uint8_t* p_;
  int64_t bits_, pos_ = 0;
};

// Bits of a position inside a chunk of `len` values.
int position_bits(int64_t len) {
  int b = 0;
  for (uint64_t x = static_cast<uint64_t>(len - 1); len > 1 && x > 0; x >>= 1) ++b;
  return b;
}

constexpr int kMaxRice = 16;

// One tensor's selection before coding: per chunk its count and scale, then every entry's
// position in its chunk and its b-bit code.
struct Selection {
  std::vector<uint16_t> counts;
  std::vector<float> scales;
  std::vector<uint16_t> pos;   // positions in the chunk, ascending per chunk
  std::vector<uint8_t> code;   // sign (bit b-1) and magnitude - 1
};

int64_t chunk_len(int64_t n, int64_t c) { return std::min(kTopkChunk, n - c * kTopkChunk); }

void select_chunk(const float* v, int64_t len, const TopkParams& p, Selection* s, float* deq) {
  const int64_t k = topk_chunk_k(p.density, len);
  std::vector<uint16_t> cand;
  for (int64_t i = 0; i < len; ++i)
    if (v[i] != 0.0f) cand.push_back(static_cast<uint16_t>(i));
  if (static_cast<int64_t>(cand.size()) > k) {
    // Largest magnitude first; equal magnitudes by lower position: one order on every machine.
    auto before = [v](uint16_t a, uint16_t b) {
      const float fa = std::fabs(v[a]), fb = std::fabs(v[b]);
      return fa > fb || (fa == fb && a < b);
    };
    std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(), before);
    cand.resize(static_cast<size_t>(k));
    std::sort(cand.begin(), cand.end());
  }
  const int levels = 1 << (p.bits - 1);
  float m = 0.0f;
  for (uint16_t i : cand) m = std::max(m, std::fabs(v[i]));
  const float scale = std::min(m / static_cast<float>(levels), kMaxTopkScale);
  // A selected value that rounds to level 0 (below half a level: a chunk with an outlier) is
  // not sent: it stays with the sender, instead of going as a whole level it does not have.
  uint16_t count = 0;
  if (scale > 0.0f)
    for (uint16_t i : cand) {
      float mag = std::nearbyint(std::fabs(v[i]) / scale);
      if (mag < 1.0f) continue;
      mag = std::min(static_cast<float>(levels), mag);
      const bool neg = v[i] < 0.0f;
      s->pos.push_back(i);
      s->code.push_back(static_cast<uint8_t>((neg ? 1u << (p.bits - 1) : 0u) |
                                             (static_cast<unsigned>(mag) - 1u)));
      if (deq) deq[i] = neg ? -(mag * scale) : mag * scale;
      ++count;
    }
  s->counts.push_back(count);
  s->scales.push_back(count > 0 ? scale : 0.0f);
}

// Gaps between consecutive positions of each chunk (the first from -1), in entry order.
std::vector<uint32_t> gaps(const Selection& s) {
  std::vector<uint32_t> g;
  size_t e = 0;
  for (uint16_t count : s.counts) {
    int64_t prev = -1;
    for (uint16_t j = 0; j < count; ++j, ++e) {
      g.push_back(static_cast<uint32_t>(s.pos[e] - prev - 1));
      prev = s.pos[e];
    }
  }
  return g;
}

uint64_t rice_bits(const std::vector<uint32_t>& g, int r) {
  uint64_t b = 0;
  for (uint32_t x : g) b += (x >> r) + 1 + static_cast<uint64_t>(r);
  return b;
}

// The index coding with the fewest bits for this tensor (ties: the lower enum value), and the
// Rice parameter when it is Rice.
TopkIndexCoding cheapest(const Selection& s, int64_t n, const std::vector<uint32_t>& g,
                         int* rice) {
  uint64_t bitmap = static_cast<uint64_t>(n), positions = 0;
  for (size_t c = 0; c < s.counts.size(); ++c)
    positions += static_cast<uint64_t>(s.counts[c]) *
                 position_bits(chunk_len(n, static_cast<int64_t>(c)));
  uint64_t best_rice = std::numeric_limits<uint64_t>::max();
  for (int r = 0; r <= kMaxRice; ++r) {
    const uint64_t b = rice_bits(g, r);
    if (b < best_rice) best_rice = b, *rice = r;
  }
  if (bitmap <= positions && bitmap <= best_rice) return TopkIndexCoding::Bitmap;
  if (positions <= best_rice) return TopkIndexCoding::Positions;
  return TopkIndexCoding::Rice;
}

void put_u32(std::string* o, uint32_t v) { o->append(reinterpret_cast<const char*>(&v), 4); }

void write_indices(BitWriter& w, const Selection& s, int64_t n, TopkIndexCoding coding, int rice,
                   const std::vector<uint32_t>& g) {
  size_t e = 0;
  for (size_t c = 0; c < s.counts.size(); ++c) {
    const int64_t len = chunk_len(n, static_cast<int64_t>(c));
    const size_t end = e + s.counts[c];
    if (coding == TopkIndexCoding::Bitmap) {
      for (int64_t i = 0; i < len; ++i) {
        const bool set = e < end && s.pos[e] == i;
        w.put(set ? 1 : 0, 1);
        if (set) ++e;
      }
    } else if (coding == TopkIndexCoding::Positions) {
      for (; e < end; ++e) w.put(s.pos[e], position_bits(len));
    } else {
      for (; e < end; ++e) {
        for (uint32_t q = g[e] >> rice; q > 0; --q) w.put(1, 1);
        w.put(0, 1);
        w.put(g[e] & ((1u << rice) - 1u), rice);
      }
    }
  }
}

}  // namespace

int64_t topk_chunk_k(double density, int64_t len) {
  const double k = std::ceil(density * static_cast<double>(len));
  return std::max<int64_t>(1, std::min<int64_t>(len, static_cast<int64_t>(k)));
}

uint64_t topk_expected_bytes(int64_t n, const TopkParams& p) {
  double bits = 0;
  const int64_t full = n / kTopkChunk, rest = n % kTopkChunk;
  for (const auto& [len, count] : {std::pair{kTopkChunk, full}, std::pair{rest, int64_t{1}}}) {
    if (len == 0 || count == 0) continue;
    const int64_t k = topk_chunk_k(p.density, len);
    // Per entry: a bitmap costs len / k bits, positions their width, Rice gaps (gap ~
    // geometric with success k / len) r + 1 + E[gap >> r] = r + 1 + q^(2^r) / (1 - q^(2^r)).
    const double q = 1.0 - static_cast<double>(k) / static_cast<double>(len);
    double index = std::min(static_cast<double>(len) / static_cast<double>(k),
                            static_cast<double>(position_bits(len)));
    for (int r = 0; r <= kMaxRice; ++r) {
      const double t = std::pow(q, std::ldexp(1.0, r));
      index = std::min(index, r + 1 + (t < 1.0 ? t / (1.0 - t) : 0.0));
    }
    bits += static_cast<double>(count) * static_cast<double>(k) * (index + p.bits);
  }
  return static_cast<uint64_t>(kTopkFixedHeader + topk_chunks(n) * 6 + std::ceil(bits / 8));
}

uint64_t topk_max_bytes(int64_t n, const TopkParams& p) {
  uint64_t bits = 0;
  for (int64_t first = 0; first < n; first += kTopkChunk) {
    const int64_t len = std::min(kTopkChunk, n - first);
    const uint64_t k = static_cast<uint64_t>(topk_chunk_k(p.density, len));
    // Rice with the largest parameter: the gaps' quotients add up to at most len ones, plus a
    // stop bit and kMaxRice low bits per entry; a bitmap is len bits, positions their width.
    const uint64_t rice = static_cast<uint64_t>(len) + k * (1 + kMaxRice);
    const uint64_t index = std::max({static_cast<uint64_t>(len),
                                     k * static_cast<uint64_t>(position_bits(len)), rice});
    bits += index + k * static_cast<uint64_t>(p.bits);
  }
  return static_cast<uint64_t>(kTopkFixedHeader) + static_cast<uint64_t>(topk_chunks(n)) * 6 +
         (bits + 7) / 8;
}

const char* topk_index_coding_name(TopkIndexCoding c) {
  switch (c) {
    case TopkIndexCoding::Bitmap: return "bitmap";
    case TopkIndexCoding::Positions: return "positions";
    case TopkIndexCoding::Rice: return "rice";
  }
  return "?";
}

int64_t topk_encode(const float* v, int64_t n, const TopkParams& p, std::string* payload,
                    float* deq, int coding) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(v[i])) return i;
  if (deq) std::fill(deq, deq + n, 0.0f);
  Selection s;
  for (int64_t c = 0; c < topk_chunks(n); ++c)
    select_chunk(v + c * kTopkChunk, chunk_len(n, c), p, &s, deq ? deq + c * kTopkChunk : nullptr);
  const std::vector<uint32_t> g = gaps(s);
  int rice = 0;
  TopkIndexCoding ic = cheapest(s, n, g, &rice);
  if (coding >= 0) ic = static_cast<TopkIndexCoding>(coding);
  // The Rice parameter goes with Rice coding only (the decoder refuses it with another one):
  // the tensors of a real model include short ones whose positions or bitmap are cheapest.
  if (ic != TopkIndexCoding::Rice) rice = 0;
  payload->clear();
  payload->push_back(static_cast<char>(kTopkFormat));
  payload->push_back(static_cast<char>(p.bits));
  payload->push_back(static_cast<char>(ic));
  payload->push_back(static_cast<char>(rice));
  put_u32(payload, static_cast<uint32_t>(s.counts.size()));
  payload->append(reinterpret_cast<const char*>(s.counts.data()), s.counts.size() * 2);
  payload->append(reinterpret_cast<const char*>(s.scales.data()), s.scales.size() * 4);
  BitWriter w(payload);
  write_indices(w, s, n, ic, rice, g);
  for (uint8_t c : s.code) w.put(c, p.bits);
  return -1;
}

namespace {

// What the 8-byte fixed header says about the index coding.
struct TopkHeader {
  TopkIndexCoding coding = TopkIndexCoding::Bitmap;
  int rice = 0;
};

// Per chunk: how many entries it carries and the scale of its values.
struct TopkChunkTable {
  std::vector<uint16_t> counts;
  std::vector<float> scales;
};

constexpr const char* kPayloadTooShort = "the payload ends before its last index or value";

// The fixed header: format, value bits, index coding, Rice parameter and chunk count.
std::string read_fixed_header(const uint8_t* b, int64_t size, int64_t n, const TopkParams& p,
                              TopkHeader* h) {
  if (size < kTopkFixedHeader)
    return "the payload has " + std::to_string(size) + " bytes, fewer than its 8-byte header";
  if (b[0] != kTopkFormat)
    return "unknown payload format " + std::to_string(b[0]) + " (this build reads format " +
           std::to_string(kTopkFormat) + ")";
  if (b[1] != p.bits)
    return "values of " + std::to_string(b[1]) + " bits where the run uses topk_bits " +
           std::to_string(p.bits);
  if (b[2] > static_cast<uint8_t>(TopkIndexCoding::Rice))
    return "unknown index coding " + std::to_string(b[2]);
  h->coding = static_cast<TopkIndexCoding>(b[2]);
  h->rice = b[3];
  if ((h->coding == TopkIndexCoding::Rice && h->rice > kMaxRice) ||
      (h->coding != TopkIndexCoding::Rice && h->rice != 0))
    return "Rice parameter " + std::to_string(h->rice) + " is not valid for index coding " +
           topk_index_coding_name(h->coding);
  uint32_t hdr_chunks;
  std::memcpy(&hdr_chunks, b + 4, 4);
  const int64_t chunks = topk_chunks(n);
  if (static_cast<int64_t>(hdr_chunks) != chunks)
    return "the header counts " + std::to_string(hdr_chunks) + " chunks; a tensor of " +
           std::to_string(n) + " values has " + std::to_string(chunks);
  return "";
}

// The per-chunk counts and scales after the fixed header, each checked against the density.
std::string read_chunk_table(const uint8_t* b, int64_t size, int64_t n, const TopkParams& p,
                             TopkChunkTable* t) {
  const int64_t chunks = topk_chunks(n);
  const int64_t head = kTopkFixedHeader + chunks * 6;
  if (size < head)
    return "the payload has " + std::to_string(size) + " bytes, fewer than the " +
           std::to_string(head) + " its header and per-chunk counts and scales need";
  t->counts.resize(static_cast<size_t>(chunks));
  t->scales.resize(static_cast<size_t>(chunks));
  std::memcpy(t->counts.data(), b + kTopkFixedHeader, static_cast<size_t>(chunks) * 2);
  std::memcpy(t->scales.data(), b + kTopkFixedHeader + chunks * 2,
              static_cast<size_t>(chunks) * 4);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t len = chunk_len(n, c), k = topk_chunk_k(p.density, len);
    const std::string where = "chunk " + std::to_string(c);
    const uint16_t count = t->counts[c];
    const float s = t->scales[c];
    if (count > k)
      return where + " carries " + std::to_string(count) + " entries; topk_density " +
             std::to_string(p.density) + " allows at most " + std::to_string(k) + " of its " +
             std::to_string(len) + " values";
    if (!std::isfinite(s)) return where + ": its scale is not finite (" + std::to_string(s) + ")";
    if (count > 0 && !(s > 0.0f && s <= kMaxTopkScale))
      return where + ": scale " + std::to_string(s) + " is not in (0, FLT_MAX/8]";
    if (count == 0 && s != 0.0f)
      return where + ": carries no entries but a scale of " + std::to_string(s);
  }
  return "";
}

// A chunk's entries as a bitmap of its `len` values: exactly `count` set bits.
std::string read_bitmap_indices(BitReader& r, int64_t len, int64_t count, const std::string& where,
                                std::vector<int64_t>* local) {
  uint64_t x;
  for (int64_t i = 0; i < len; ++i) {
    if (!r.get(1, &x)) return kPayloadTooShort;
    if (x) local->push_back(i);
  }
  if (static_cast<int64_t>(local->size()) != count)
    return where + ": its bitmap holds " + std::to_string(local->size()) +
           " entries but its count says " + std::to_string(count);
  return "";
}

// The next index after `prev` as a Rice-coded gap (unary quotient, `rice` low bits).
std::string read_rice_index(BitReader& r, int rice, int64_t len, int64_t prev,
                            const std::string& where, int64_t* i) {
  uint64_t x, q = 0;
  for (;;) {
    if (!r.get(1, &x)) return kPayloadTooShort;
    if (!x) break;
    if ((++q << rice) >= static_cast<uint64_t>(len))
      return where + ": an index gap runs past the chunk's " + std::to_string(len) + " values";
  }
  uint64_t low = 0;
  if (!r.get(rice, &low)) return kPayloadTooShort;
  *i = prev + 1 + static_cast<int64_t>((q << rice) | low);
  return "";
}

// A chunk's `count` entries as fixed-width positions or Rice-coded gaps: ascending, no repeats,
// inside the chunk.
std::string read_listed_indices(BitReader& r, const TopkHeader& h, int64_t len, int64_t count,
                                const std::string& where, std::vector<int64_t>* local) {
  int64_t prev = -1;
  for (int64_t j = 0; j < count; ++j) {
    int64_t i;
    if (h.coding == TopkIndexCoding::Positions) {
      uint64_t x;
      if (!r.get(position_bits(len), &x)) return kPayloadTooShort;
      i = static_cast<int64_t>(x);
      if (i == prev) return where + ": position " + std::to_string(i) + " is repeated";
      if (i < prev)
        return where + ": positions are not ascending (" + std::to_string(i) + " after " +
               std::to_string(prev) + ")";
    } else if (std::string e = read_rice_index(r, h.rice, len, prev, where, &i); !e.empty()) {
      return e;
    }
    if (i >= len)
      return where + ": index " + std::to_string(i) + " is out of range (the chunk has " +
             std::to_string(len) + " values)";
    local->push_back(i);
    prev = i;
  }
  return "";
}

// Every chunk's indices, as positions in the whole tensor.
std::string read_indices(BitReader& r, const TopkHeader& h, const TopkChunkTable& t, int64_t n,
                         std::vector<int64_t>* index) {
  std::vector<int64_t> local;
  for (int64_t c = 0; c < static_cast<int64_t>(t.counts.size()); ++c) {
    const int64_t len = chunk_len(n, c), count = t.counts[c];
    const std::string where = "chunk " + std::to_string(c);
    local.clear();
    const std::string e = h.coding == TopkIndexCoding::Bitmap
                              ? read_bitmap_indices(r, len, count, where, &local)
                              : read_listed_indices(r, h, len, count, where, &local);
    if (!e.empty()) return e;
    for (int64_t i : local) index->push_back(c * kTopkChunk + i);
  }
  return "";
}

// The values, in entry order: sign (bit bits-1) and magnitude - 1, times the chunk's scale.
std::string read_values(BitReader& r, const TopkChunkTable& t, int bits,
                        std::vector<float>* value) {
  const uint64_t sign = 1u << (bits - 1);
  for (size_t c = 0; c < t.counts.size(); ++c)
    for (int j = 0; j < t.counts[c]; ++j) {
      uint64_t x;
      if (!r.get(bits, &x)) return kPayloadTooShort;
      const float v = static_cast<float>((x & (sign - 1)) + 1) * t.scales[c];
      value->push_back((x & sign) ? -v : v);
    }
  return "";
}

}  // namespace

std::string topk_decode(const uint8_t* b, int64_t size, int64_t n, const TopkParams& p,
                        TopkSparse* out) {
  out->index.clear();
  out->value.clear();
  TopkHeader h;
  TopkChunkTable t;
  if (std::string e = read_fixed_header(b, size, n, p, &h); !e.empty()) return e;
  if (std::string e = read_chunk_table(b, size, n, p, &t); !e.empty()) return e;
  const int64_t head = kTopkFixedHeader + topk_chunks(n) * 6;
  BitReader r(b + head, size - head);
  if (std::string e = read_indices(r, h, t, n, &out->index); !e.empty()) return e;
  if (std::string e = read_values(r, t, p.bits, &out->value); !e.empty()) return e;
  if (r.size_bits() - r.pos() >= 8 || !r.rest_zero())
    return "the payload holds " + std::to_string((r.size_bits() - r.pos()) / 8) +
           " bytes (or padding bits) after its last value";
  return "";
}

void topk_rebuild(const float* prev, const TopkSparse& s, int64_t first, int64_t n, float* out) {
  if (prev != out) {
    if (prev) std::memcpy(out, prev, static_cast<size_t>(n) * 4);
    else std::fill(out, out + n, 0.0f);
  }
  auto it = std::lower_bound(s.index.begin(), s.index.end(), first);
  for (; it != s.index.end() && *it < first + n; ++it) {
    const int64_t k = *it - first;
    const float dq = s.value[static_cast<size_t>(it - s.index.begin())];
    out[k] = prev ? out[k] + dq : dq;
  }
}

}  // namespace spes::sync
