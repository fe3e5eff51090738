// PCRE2-backed splitting for Hugging Face pre-tokenizers (see hf_regex_split.h). Each thread
// keeps its own match data and JIT stack, so one compiled pattern serves any number of threads.
#include "spes/data/hf_regex_split.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cctype>
#include <utility>

#include "spes/common/error.h"

namespace spes {

const char* const kGpt2SplitPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

SplitBehavior split_behavior_parse(const std::string& name, const std::string& origin) {
  if (name == "Removed") return SplitBehavior::Removed;
  if (name == "Isolated") return SplitBehavior::Isolated;
  if (name == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (name == "Contiguous") return SplitBehavior::Contiguous;
  fail("{}: unknown split behavior '{}' (expected Removed, Isolated, MergedWithPrevious, "
       "MergedWithNext or Contiguous)", origin, name);
}

namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof(buf));
  return reinterpret_cast<const char*>(buf);
}

// Per-thread match state: match data and a JIT stack large enough for long whitespace runs.
struct MatchScratch {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mctx = nullptr;
  pcre2_jit_stack* stack = nullptr;
  MatchScratch() {
    md = pcre2_match_data_create(16, nullptr);
    mctx = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    if (stack) pcre2_jit_stack_assign(mctx, nullptr, stack);
  }
  ~MatchScratch() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(mctx);
    pcre2_match_data_free(md);
  }
};

MatchScratch& match_scratch() {
  thread_local MatchScratch s;
  return s;
}

struct Segment {
  size_t begin, end;
  bool is_match;
};

}  // namespace

struct RegexSplitter::Impl {
  pcre2_code* code = nullptr;
  SplitBehavior behavior;
  bool invert;
  std::string origin;
  ~Impl() { pcre2_code_free(code); }
};

RegexSplitter::RegexSplitter(const std::string& pattern, SplitBehavior behavior, bool invert,
                             const std::string& origin)
    : impl_(std::make_unique<Impl>()) {
  impl_->behavior = behavior;
  impl_->invert = invert;
  impl_->origin = origin;
  int err = 0;
  PCRE2_SIZE off = 0;
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                              PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
  SPES_CHECK(impl_->code != nullptr, "{}: regex does not compile at offset {}: {} (pattern: {})",
             origin, off, pcre2_message(err), pattern);
  pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter on failure
}

RegexSplitter::~RegexSplitter() = default;
RegexSplitter::RegexSplitter(RegexSplitter&&) noexcept = default;

void RegexSplitter::split(const std::string& text, std::vector<std::string>& out) const {
  const size_t n = text.size();
  if (n == 0) return;
  MatchScratch& ms = match_scratch();
  auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());

  // 1. Matches and the gaps between them, covering the text.
  std::vector<Segment> segs;
  size_t pos = 0, last = 0;
  while (pos < n) {
    int rc = pcre2_match(impl_->code, subject, n, pos, PCRE2_NO_UTF_CHECK, ms.md, ms.mctx);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    SPES_CHECK(rc >= 0, "{}: regex match failed: {}", impl_->origin, pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(ms.md);
    size_t b = ov[0], e = ov[1];
    if (e == b) {  // empty match: step over one code point
      pos = b + 1;
      while (pos < n && (static_cast<unsigned char>(text[pos]) & 0xC0) == 0x80) ++pos;
      continue;
    }
    if (b > last) segs.push_back({last, b, false});
    segs.push_back({b, e, true});
    last = pos = e;
  }
  if (last < n) segs.push_back({last, n, false});
  if (impl_->invert)
    for (auto& s : segs) s.is_match = !s.is_match;

  // 2. Apply the behavior (same folds as HF's NormalizedString::split).
  std::vector<Segment> res;
  switch (impl_->behavior) {
    case SplitBehavior::Isolated:
      res = std::move(segs);
      break;
    case SplitBehavior::Removed:
      for (auto& s : segs)
        if (!s.is_match) res.push_back(s);
      break;
    case SplitBehavior::MergedWithPrevious: {
      bool prev_match = false;
      for (auto& s : segs) {
        if (s.is_match && !prev_match && !res.empty()) res.back().end = s.end;
        else res.push_back(s);
        prev_match = s.is_match;
      }
      break;
    }
    case SplitBehavior::MergedWithNext: {
      bool next_match = false;
      for (size_t i = segs.size(); i-- > 0;) {
        const Segment& s = segs[i];
        if (s.is_match && !next_match && !res.empty()) res.back().begin = s.begin;
        else res.push_back(s);
        next_match = s.is_match;
      }
      std::reverse(res.begin(), res.end());
      break;
    }
    case SplitBehavior::Contiguous: {
      bool prev_match = false;
      for (size_t i = 0; i < segs.size(); ++i) {
        if (i > 0 && segs[i].is_match == prev_match) res.back().end = segs[i].end;
        else res.push_back(segs[i]);
        prev_match = segs[i].is_match;
      }
      break;
    }
  }
  for (const auto& s : res)
    if (s.end > s.begin) out.emplace_back(text, s.begin, s.end - s.begin);
}

std::string regex_escape(const std::string& literal) {
  std::string r;
  for (char c : literal) {
    unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u) && c != '_' && c != ' ') r.push_back('\\');
    r.push_back(c);
  }
  return r;
}

}  // namespace spes
