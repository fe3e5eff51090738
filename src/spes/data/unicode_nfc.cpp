// UTF-8 repair and NFC normalization (see unicode_nfc.h). The tables in unicode_nfc_data.inc are
// parsed once, on first use, into hash maps. Leaves out: stream-safe text format limits (very
// long runs of combining marks are sorted whole), NFKC/NFKD.
#include "spes/data/unicode_nfc.h"

#include <algorithm>
#include <cstdlib>
#include <unordered_map>
#include <vector>

namespace spes {
namespace {

#include "spes/data/unicode_nfc_data.inc"

constexpr uint32_t kReplacement = 0xFFFD;
// Hangul syllable arithmetic (Unicode 3.12).
constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount,
                   kSCount = kLCount * kNCount;

struct NfcTables {
  std::unordered_map<uint32_t, std::pair<uint32_t, uint32_t>> decomp;  // second 0: singleton
  std::unordered_map<uint64_t, uint32_t> compose;                     // (a << 21 | b) -> c
  std::unordered_map<uint32_t, uint8_t> ccc;

  NfcTables() {
    const char* p = kNfcDecomp;
    while (*p) {
      char* e;
      uint32_t cp = std::strtoul(p, &e, 16);
      bool excluded = *e == '!';
      e += excluded ? 2 : 1;  // skip "!=" or "="
      uint32_t a = std::strtoul(e, &e, 16), b = 0;
      if (*e == ',') b = std::strtoul(e + 1, &e, 16);
      decomp[cp] = {a, b};
      if (b != 0 && !excluded) compose[(uint64_t(a) << 21) | b] = cp;
      while (*e == ' ') ++e;
      p = e;
    }
    p = kNfcCcc;
    while (*p) {
      char* e;
      uint32_t first = std::strtoul(p, &e, 16), last = first;
      if (*e == '-') last = std::strtoul(e + 1, &e, 16);
      uint8_t cls = static_cast<uint8_t>(std::strtoul(e + 1, &e, 16));
      for (uint32_t c = first; c <= last; ++c) ccc[c] = cls;
      while (*e == ' ') ++e;
      p = e;
    }
  }
  uint8_t combining_class(uint32_t c) const {
    if (c < 0x300) return 0;
    auto it = ccc.find(c);
    return it == ccc.end() ? 0 : it->second;
  }
  void decompose(uint32_t c, std::vector<uint32_t>& out) const {
    if (c >= kSBase && c < kSBase + kSCount) {
      uint32_t s = c - kSBase;
      out.push_back(kLBase + s / kNCount);
      out.push_back(kVBase + (s % kNCount) / kTCount);
      if (s % kTCount) out.push_back(kTBase + s % kTCount);
      return;
    }
    auto it = c < 0xC0 ? decomp.end() : decomp.find(c);
    if (it == decomp.end()) {
      out.push_back(c);
      return;
    }
    decompose(it->second.first, out);
    if (it->second.second) decompose(it->second.second, out);
  }
  // The primary composite of (a, b), or 0.
  uint32_t compose_pair(uint32_t a, uint32_t b) const {
    if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
      return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
    if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase &&
        b < kTBase + kTCount)
      return a + (b - kTBase);
    auto it = compose.find((uint64_t(a) << 21) | b);
    return it == compose.end() ? 0 : it->second;
  }
};

const NfcTables& nfc_tables() {
  static const NfcTables t;
  return t;
}

}  // namespace

std::string utf8_make_valid(const std::string& s) {
  const auto* b = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n && b[i] < 0x80) ++i;  // ASCII prefix: usually the whole text
  if (i == n) return s;
  std::string out(s, 0, i);
  out.reserve(n + 8);
  while (i < n) {
    unsigned char c = b[i];
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
      ++i;
      continue;
    }
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) { len = 3; if (c == 0xE0) lo = 0xA0; if (c == 0xED) hi = 0x9F; }
    else if (c >= 0xF0 && c <= 0xF4) { len = 4; if (c == 0xF0) lo = 0x90; if (c == 0xF4) hi = 0x8F; }
    size_t k = 1;
    if (len) {
      while (k < len && i + k < n) {
        unsigned char d = b[i + k];
        bool ok = k == 1 ? (d >= lo && d <= hi) : (d >= 0x80 && d <= 0xBF);
        if (!ok) break;
        ++k;
      }
    }
    if (len && k == len) {
      out.append(s, i, len);
    } else {
      utf8_append(out, kReplacement);  // one U+FFFD per maximal invalid subpart
    }
    i += k;
  }
  return out;
}

uint32_t utf8_next(const std::string& s, size_t& i) {
  const auto* b = reinterpret_cast<const unsigned char*>(s.data());
  uint32_t c = b[i];
  if (c < 0x80) { i += 1; return c; }
  if (c < 0xE0) { c = ((c & 0x1F) << 6) | (b[i + 1] & 0x3F); i += 2; return c; }
  if (c < 0xF0) {
    c = ((c & 0x0F) << 12) | ((b[i + 1] & 0x3F) << 6) | (b[i + 2] & 0x3F);
    i += 3;
    return c;
  }
  c = ((c & 0x07) << 18) | ((b[i + 1] & 0x3F) << 12) | ((b[i + 2] & 0x3F) << 6) | (b[i + 3] & 0x3F);
  i += 4;
  return c;
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool unicode_is_white_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

std::string utf8_nfc(const std::string& s) {
  // Fast path: a code point >= U+0300 needs a lead byte >= 0xCC.
  bool simple = true;
  for (unsigned char c : s) {
    if (c >= 0xCC) { simple = false; break; }
  }
  if (simple) return s;

  const NfcTables& t = nfc_tables();
  std::vector<uint32_t> cps;
  cps.reserve(s.size());
  for (size_t i = 0; i < s.size();) t.decompose(utf8_next(s, i), cps);

  // Canonical ordering: stable sort of each run of non-starters by combining class.
  for (size_t i = 0; i < cps.size();) {
    if (t.combining_class(cps[i]) == 0) { ++i; continue; }
    size_t j = i;
    while (j < cps.size() && t.combining_class(cps[j]) != 0) ++j;
    std::stable_sort(cps.begin() + i, cps.begin() + j, [&](uint32_t a, uint32_t b) {
      return t.combining_class(a) < t.combining_class(b);
    });
    i = j;
  }

  // Canonical composition.
  std::vector<uint32_t> out;
  out.reserve(cps.size());
  long starter = -1;  // index in `out` of the last starter
  int last_class = -1;  // class of the last char appended after the starter; -1: none
  for (uint32_t c : cps) {
    int cls = t.combining_class(c);
    if (starter >= 0 && (last_class == -1 || last_class < cls)) {
      if (uint32_t comp = t.compose_pair(out[starter], c)) {
        out[starter] = comp;
        continue;
      }
    }
    if (cls == 0) {
      starter = static_cast<long>(out.size());
      last_class = -1;
    } else {
      last_class = cls;
    }
    out.push_back(c);
  }
  std::string r;
  r.reserve(s.size());
  for (uint32_t c : out) utf8_append(r, c);
  return r;
}

}  // namespace spes
