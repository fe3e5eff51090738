// Added-token splitting (see hf_added_tokens.h): a byte trie gives, at each start position, the
// longest token; the first position with a match wins (leftmost-longest, as aho-corasick's
// LeftmostLongest in the reference).
#include "spes/data/hf_added_tokens.h"

#include <algorithm>
#include <cctype>

#include "spes/data/unicode_nfc.h"

namespace spes {
namespace {

// Rust's `c.is_alphanumeric() || c == '_'`, approximated: ASCII letters, digits and '_', and
// every non-ASCII code point that is not whitespace.
bool is_word_char(uint32_t c) {
  if (c < 0x80) return std::isalnum(static_cast<int>(c)) || c == '_';
  return !unicode_is_white_space(c);
}

// The code point that ends at byte `end` of valid UTF-8 `s` (end > 0).
uint32_t last_char_before(const std::string& s, size_t end) {
  size_t b = end - 1;
  while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
  return utf8_next(s, b);
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(std::vector<HfAddedToken> tokens) : tokens_(std::move(tokens)) {
  trie_.emplace_back();
  for (size_t t = 0; t < tokens_.size(); ++t) {
    const std::string& c = tokens_[t].content;
    if (c.empty()) continue;
    first_byte_[static_cast<unsigned char>(c[0])] = true;
    int32_t node = 0;
    for (unsigned char b : c) {
      int32_t nx = child(node, b);
      if (nx < 0) {
        nx = static_cast<int32_t>(trie_.size());
        trie_.emplace_back();
        auto& v = trie_[node].next;
        v.insert(std::lower_bound(v.begin(), v.end(), std::make_pair(b, int32_t(-1))),
                 std::make_pair(b, nx));
      }
      node = nx;
    }
    if (trie_[node].token < 0) trie_[node].token = static_cast<int32_t>(t);  // first one wins
  }
}

int32_t AddedTokenMatcher::child(int32_t node, unsigned char b) const {
  const auto& v = trie_[node].next;
  auto it = std::lower_bound(v.begin(), v.end(), std::make_pair(b, int32_t(-1)));
  return (it != v.end() && it->first == b) ? it->second : -1;
}

void AddedTokenMatcher::split(const std::string& text, std::vector<TextPiece>& out) const {
  const size_t n = text.size();
  size_t emitted = 0;  // text[0, emitted) is already in `out`
  size_t i = 0;
  while (i < n) {
    if (!first_byte_[static_cast<unsigned char>(text[i])]) { ++i; continue; }
    // Longest token starting at i.
    int32_t node = 0, best = -1;
    size_t best_end = i;
    for (size_t j = i; j < n; ++j) {
      node = child(node, static_cast<unsigned char>(text[j]));
      if (node < 0) break;
      if (trie_[node].token >= 0) { best = trie_[node].token; best_end = j + 1; }
    }
    if (best < 0) { ++i; continue; }
    const HfAddedToken& tok = tokens_[best];
    size_t start = i, stop = best_end;
    if (start < emitted) { i = best_end; continue; }  // inside a previous rstrip extension
    if (tok.single_word) {
      bool start_ok = start == 0 || !is_word_char(last_char_before(text, start));
      size_t k = stop;
      bool stop_ok = stop == n || !is_word_char(utf8_next(text, k));
      if (!start_ok || !stop_ok) { i = best_end; continue; }  // as the reference: no rescan
    }
    if (tok.lstrip) {
      size_t s = start;
      while (s > emitted && unicode_is_white_space(last_char_before(text, s))) {
        size_t b = s - 1;
        while (b > 0 && (static_cast<unsigned char>(text[b]) & 0xC0) == 0x80) --b;
        s = b;
      }
      start = s;
    }
    if (tok.rstrip) {
      while (stop < n) {
        size_t k = stop;
        if (!unicode_is_white_space(utf8_next(text, k))) break;
        stop = k;
      }
    }
    if (emitted < start) out.push_back({text.substr(emitted, start - emitted), -1});
    out.push_back({text.substr(start, stop - start), tok.id});
    emitted = stop;
    i = best_end > stop ? best_end : stop;
  }
  if (emitted < n) out.push_back({text.substr(emitted), -1});
}

}  // namespace spes
