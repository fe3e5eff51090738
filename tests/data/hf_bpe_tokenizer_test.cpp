// Tests of the native tokenizer.json BPE: ids against Hugging Face's own implementation (the
// `tokenizers` package from PyPI, through tests/data/hf_tokenizers_reference.py) on varied
// text, decode round trips, and a tiny hand-written tokenizer whose ids are worked out by hand
// (merge priority, both merge forms, added tokens, Split pre-tokenizer, NFC).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <thread>

#include "data/data_test_util.h"
#include "python_reference.h"
#include "spes/common/error.h"
#include "spes/data/hf_bpe_tokenizer.h"
#include "spes/data/tokenizer.h"
#include "spes/data/unicode_nfc.h"
#include "spes/io/files.h"

namespace {
namespace fs = std::filesystem;
using json = nlohmann::json;
using Ids = std::vector<int64_t>;

const std::string kNeox = std::string(SPES_ASSETS_DIR) + "/tokenizers/gpt-neox-olmo-dolma-v1_5.json";

const std::vector<std::string> kTexts = {
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "hello  world",
    "   leading spaces",
    "trailing spaces   ",
    "a\t\tb\n\n c",
    "line1\nline2\r\nline3\n",
    "Numbers: 1234567890 3.14159 -42 1,000,000",
    "Punctuation!!! ??? ... --- ''' \"quoted\" (parens) [brackets] {braces}",
    "I'm you're he's we've they'll I'd it's",
    "Don't SHOUT; IT'S RUDE.",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00c5ngstr\u00f6m",
    "decomposed: e\u0301 A\u030a o\u0308\u0304",
    "\u00dcn\u00efc\u00f6d\u00e9 \u00dftra\u00dfe",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "\u4e2d\u6587\u6d4b\u8bd5\uff0c\u4f60\u597d\uff01",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8 \u1100\u1161\u11a8",
    "emoji \U0001F917\U0001F389\U0001F44D\U0001F3FD family \U0001F468\u200D\U0001F469\u200D\U0001F467",
    "<|padding|>",
    "a <|padding|>  b<|padding|>\n",
    "x|||IP_ADDRESS|||y and |||IP_ADDRESS||| ok",
    "text<|endoftext|>more <|endoftext|> end",
    "|||IP_ADDRESS||| and |||EMAIL_ADDRESS|||",
    "x" + std::string(40, ' ') + "y",
    "    def f(x):\n        return x * 2\n",
    "URL https://example.com/path?q=1&r=2#frag",
    "email: someone@example.org",
    "mixed\u00a0nbsp and\u2003em space",
    "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac \u041a\u0438\u0440\u0438\u043b\u043b\u0438\u0446\u0430",
    "\u0627\u0644\u0639\u0631\u0628\u064a\u0629",
    "",
    "\n\n\n",
    " ",
    "a  ",
    "\ufb01 ligature \u2460 \u216b \u212b",
    "supercalifragilisticexpialidocioussupercalifragilisticexpialidocious",
};

// Ids and decoded text of every text from Hugging Face's `tokenizers` (tests/data/
// hf_tokenizers_reference.py).
json reference_encodings(const std::string& tokenizer, const std::vector<std::string>& texts) {
  spes::test::TempDir tmp;
  spes::test::write_bytes(tmp.file("inputs.json"), json(texts).dump());
  return json::parse(spes::test::run_python_reference("data/hf_tokenizers_reference.py",
                                                      {tokenizer, tmp.file("inputs.json")}));
}

// Compares encode() and decode() of every text with the reference.
void compare_with_reference(const std::string& tokenizer_file) {
  const json ref = reference_encodings(tokenizer_file, kTexts);
  ASSERT_EQ(ref.size(), kTexts.size());
  auto tok = spes::tokenizer_load(tokenizer_file);
  EXPECT_EQ(tok->kind(), "hf-bpe");
  for (size_t i = 0; i < kTexts.size() && i < ref.size(); ++i) {
    const Ids expect = ref[i]["ids"].get<Ids>();
    const Ids got = tok->encode(kTexts[i]);
    EXPECT_EQ(got, expect) << "text #" << i << ": " << json(kTexts[i]).dump();
    EXPECT_EQ(tok->decode(got), ref[i]["decoded"].get<std::string>()) << "text #" << i;
  }
}

TEST(HfBpeTokenizer, MatchesReferenceImplementation) {
  ASSERT_TRUE(fs::exists(kNeox)) << "missing test tokenizer " << kNeox;
  compare_with_reference(kNeox);
}

// The same vocabulary behind Qwen2- and Llama-3-style pre-tokenizers (a Split regex in a
// Sequence, ByteLevel without its regex, ignore_merges) and added tokens with lstrip/rstrip/
// single_word, all checked against the reference.
TEST(HfBpeTokenizer, MatchesReferenceWithSplitPreTokenizers) {
  const std::string qwen =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  const std::string llama3 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  spes::test::TempDir tmp;
  int variant = 0;
  for (const std::string& pattern : {qwen, llama3}) {
    json j = json::parse(spes::file_read(kNeox));
    j["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers",
                           {{{"type", "Split"}, {"pattern", {{"Regex", pattern}}},
                             {"behavior", "Isolated"}, {"invert", false}},
                            {{"type", "ByteLevel"}, {"add_prefix_space", false},
                             {"trim_offsets", false}, {"use_regex", false}}}}};
    j["model"]["ignore_merges"] = variant == 1;
    for (auto& a : j["added_tokens"]) {
      if (a["content"] == "<|padding|>") a["lstrip"] = a["rstrip"] = true;
      if (a["content"] == "|||IP_ADDRESS|||") a["single_word"] = true;
    }
    const std::string file = tmp.file("variant" + std::to_string(variant++) + ".json");
    spes::test::write_bytes(file, j.dump());
    compare_with_reference(file);
  }
}

TEST(HfBpeTokenizer, NeoxBasicsAndRoundTrip) {
  auto tok = spes::tokenizer_load(kNeox);
  EXPECT_EQ(tok->encode("Hello world"), (Ids{12092, 1533}));  // also checked by the reference
  EXPECT_EQ(tok->vocab_size(), 50280);
  EXPECT_EQ(tok->eos_id(), 50279);  // <|endoftext|>
  EXPECT_EQ(tok->encode("<|padding|>"), (Ids{1}));
  for (size_t i = 0; i < kTexts.size(); ++i)  // normalization (NFC) is the only change
    EXPECT_EQ(tok->decode(tok->encode(kTexts[i])), spes::utf8_nfc(kTexts[i])) << "text #" << i;
  EXPECT_EQ(tok->decode(tok->encode("caf\u00e9")), "caf\u00e9");
  // Invalid UTF-8 is repaired (U+FFFD) rather than rejected, like Rust's from_utf8_lossy.
  EXPECT_EQ(tok->decode(tok->encode("a\xff" "b")), "a\xef\xbf\xbd" "b");
  EXPECT_THROW(tok->decode({50280}), spes::Error);
}

TEST(HfBpeTokenizer, ThreadsGiveTheSameIds) {
  auto tok = spes::tokenizer_load(kNeox);
  std::string text;
  for (const auto& t : kTexts) text += t + "\n\n";
  const Ids one = tok->encode(text);
  Ids a, b;
  std::thread ta([&] { for (int i = 0; i < 20; ++i) a = tok->encode(text); });
  std::thread tb([&] { for (int i = 0; i < 20; ++i) b = tok->encode(text); });
  ta.join();
  tb.join();
  EXPECT_EQ(a, one);
  EXPECT_EQ(b, one);
}

// A tiny byte-level BPE: ids worked out by hand.
json tiny_tokenizer() {
  return json::parse(R"({
    "version": "1.0",
    "added_tokens": [
      {"id": 0, "content": "<|endoftext|>", "single_word": false, "lstrip": false,
       "rstrip": false, "normalized": false, "special": true}],
    "normalizer": {"type": "NFC"},
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                      "use_regex": true},
    "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                "use_regex": true},
    "model": {"type": "BPE", "dropout": null, "unk_token": null,
      "vocab": {"<|endoftext|>": 0, "a": 1, "b": 2, "c": 3, "\u0120": 4, "ab": 5, "abc": 6,
                "\u0120a": 7, "\u0120ab": 8, "!": 9, "bc": 10, "1": 11, "\u00c3": 12,
                "\u00a9": 13, "\u00c3\u00a9": 14},
      "merges": ["\u0120 a", "a b", "ab c", ["\u0120a", "b"], "b c", "\u00c3 \u00a9"]}
  })");
}

TEST(HfBpeTokenizer, TinyTokenizerByHand) {
  auto tok = spes::HfBpeTokenizer::from_json(tiny_tokenizer().dump(), "tiny");
  EXPECT_EQ(tok->vocab_size(), 15);
  EXPECT_EQ(tok->eos_id(), 0);
  EXPECT_EQ(tok->encode("abc"), (Ids{6}));         // a+b (rank 1), then ab+c (rank 2)
  EXPECT_EQ(tok->encode(" ab"), (Ids{8}));         // Ġ+a (rank 0) first, then [Ġa, b] (array form)
  EXPECT_EQ(tok->encode(" abc"), (Ids{8, 3}));     // Ġab + c has no merge
  EXPECT_EQ(tok->encode("cab"), (Ids{3, 5}));
  EXPECT_EQ(tok->encode("bc"), (Ids{10}));
  EXPECT_EQ(tok->encode("abc!"), (Ids{6, 9}));     // regex splits letters from punctuation
  EXPECT_EQ(tok->encode("ab<|endoftext|>c"), (Ids{5, 0, 3}));
  EXPECT_EQ(tok->encode("e\u0301"), (Ids{14}));  // NFC: e + U+0301 -> U+00E9 = C3 A9
  EXPECT_EQ(tok->encode("z"), Ids{});              // bytes without a vocab entry are dropped
  EXPECT_EQ(tok->decode({8, 3, 0, 14}), " abc<|endoftext|>\u00e9");
  EXPECT_EQ(tok->id_to_token(8), "\u0120ab");
  EXPECT_EQ(tok->token_to_id("abc"), 6);
}

TEST(HfBpeTokenizer, TinyTokenizerWithSplitSequence) {
  json j = tiny_tokenizer();
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = json::parse(R"({"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "b"}, "behavior": "MergedWithPrevious",
       "invert": false},
      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
       "use_regex": false}]})");
  auto tok = spes::HfBpeTokenizer::from_json(j.dump(), "tiny-split");
  // Pieces "ab" | "cab": without the Split, "abcab" would be [abc, ab] = {6, 5}.
  EXPECT_EQ(tok->encode("abcab"), (Ids{5, 3, 5}));
  EXPECT_EQ(tok->encode("e\u0301"), Ids{});  // no normalizer: nothing of it is in the vocab

  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Isolated";
  tok = spes::HfBpeTokenizer::from_json(j.dump(), "tiny-isolated");
  EXPECT_EQ(tok->encode("abcab"), (Ids{1, 2, 3, 1, 2}));  // "a" "b" "ca" "b": no merge applies
}

TEST(HfBpeTokenizer, ClearErrors) {
  spes::test::TempDir tmp;
  auto msg = [](auto fn) {
    try {
      fn();
    } catch (const spes::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(msg([&] { spes::tokenizer_load(tmp.file("nope.json")); }).find("does not exist"),
            std::string::npos);
  spes::test::write_bytes(tmp.file("bad.json"), "{\"model\": ");
  EXPECT_NE(msg([&] { spes::tokenizer_load(tmp.file("bad.json")); }).find("not valid JSON"),
            std::string::npos);
  spes::test::write_bytes(tmp.file("garbage.model"), "\x01\x02garbage");
  EXPECT_NE(msg([&] { spes::tokenizer_load(tmp.file("garbage.model")); }).find("neither"),
            std::string::npos);
  json j = tiny_tokenizer();
  j["model"]["merges"].push_back("a zz");
  EXPECT_NE(msg([&] { spes::HfBpeTokenizer::from_json(j.dump(), "t"); }).find("'zz' is not in"),
            std::string::npos);
  j = tiny_tokenizer();
  j["normalizer"] = {{"type", "Lowercase"}};
  EXPECT_NE(msg([&] { spes::HfBpeTokenizer::from_json(j.dump(), "t"); }).find("'Lowercase'"),
            std::string::npos);
  j = tiny_tokenizer();
  j["added_tokens"] = json::array();
  j["model"]["vocab"].erase("<|endoftext|>");
  j["model"]["vocab"]["x"] = 0;
  EXPECT_NE(msg([&] { spes::HfBpeTokenizer::from_json(j.dump(), "t"); }).find("end-of-document"),
            std::string::npos);
}

}  // namespace
