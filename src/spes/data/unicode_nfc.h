// UTF-8 helpers for tokenizers: lossy UTF-8 repair (invalid bytes become U+FFFD, like Rust's
// String::from_utf8_lossy), code point decoding, Unicode White_Space, and NFC normalization
// (canonical decomposition, canonical ordering, canonical composition incl. Hangul) from tables
// generated out of Unicode 14 data (scripts/gen_unicode_nfc.py). Leaves out: NFKC/NFKD and
// case folding.
#pragma once
#include <cstdint>
#include <string>

namespace spes {

// `s` with every ill-formed UTF-8 sequence (maximal subpart) replaced by U+FFFD.
std::string utf8_make_valid(const std::string& s);
// Decodes the code point at s[i] (s must be valid UTF-8) and advances i past it.
uint32_t utf8_next(const std::string& s, size_t& i);
void utf8_append(std::string& out, uint32_t cp);
// Unicode White_Space property (what Rust's char::is_whitespace tests).
bool unicode_is_white_space(uint32_t cp);
// NFC of valid UTF-8 text. Text with no code point >= U+0300 is returned unchanged (fast path:
// everything below U+0300 is NFC-stable).
std::string utf8_nfc(const std::string& s);

}  // namespace spes
