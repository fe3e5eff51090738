// Splitting text on Hugging Face "added tokens" the way the `tokenizers` library does
// (AddedVocabulary::find_matches): leftmost-longest matches over all token contents; a
// single_word token only matches between non-word characters; lstrip/rstrip extend the match
// over neighbouring whitespace. Leaves out: encode_special_tokens (specials always split out).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace spes {

struct HfAddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool normalized = true;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
};

// A piece of text: an added token (id >= 0) or plain text still to be tokenized (id < 0).
struct TextPiece {
  std::string text;
  int32_t id = -1;
};

class AddedTokenMatcher {
 public:
  AddedTokenMatcher() = default;
  explicit AddedTokenMatcher(std::vector<HfAddedToken> tokens);
  bool empty() const { return tokens_.empty(); }
  // Appends the pieces of `text` (valid UTF-8) to `out`, in order.
  void split(const std::string& text, std::vector<TextPiece>& out) const;

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> next;  // sorted by byte
    int32_t token = -1;                                   // index into tokens_
  };
  int32_t child(int32_t node, unsigned char b) const;
  std::vector<HfAddedToken> tokens_;
  std::vector<Node> trie_;
  bool first_byte_[256] = {};
};

}  // namespace spes
