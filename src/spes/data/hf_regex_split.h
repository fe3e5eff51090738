// Regex splitting as the Hugging Face `tokenizers` pre-tokenizers do it (Split, and the GPT-2
// regex inside ByteLevel), over PCRE2 in UTF + UCP mode with JIT when available. Differences
// from the reference (Oniguruma): PCRE2 10.42's \s (UCP) does not match U+0085.
// Leaves out: look-around constructs PCRE2 lacks (none in known tokenizers).
#pragma once
#include <memory>
#include <string>
#include <vector>

namespace spes {

// What happens to the regex matches (HF SplitDelimiterBehavior).
enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// Parses "Removed" | "Isolated" | "MergedWithPrevious" | "MergedWithNext" | "Contiguous".
SplitBehavior split_behavior_parse(const std::string& name, const std::string& origin);

// The GPT-2 pre-tokenizer pattern used by ByteLevel(use_regex=true).
extern const char* const kGpt2SplitPattern;

class RegexSplitter {
 public:
  // `origin` names the pattern in errors (file and field). Throws spes::Error on a bad pattern.
  RegexSplitter(const std::string& pattern, SplitBehavior behavior, bool invert,
                const std::string& origin);
  ~RegexSplitter();
  RegexSplitter(RegexSplitter&&) noexcept;
  // Appends the non-empty pieces of `text` (valid UTF-8) to `out`.
  void split(const std::string& text, std::vector<std::string>& out) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// `literal` with every PCRE2 metacharacter escaped (for Split patterns given as a String).
std::string regex_escape(const std::string& literal);

}  // namespace spes
