// Tests of SentencePiece training and the wrapper: a tiny model trained on generated text must
// round-trip any text (byte fallback, identity normalization, kept whitespace), report eos 2,
// and be picked by tokenizer_load from its content; the sentence sampler is deterministic.
#include <gtest/gtest.h>

#include <random>

#include "data/data_test_util.h"
#include "spes/common/error.h"
#include "spes/data/sentencepiece_tokenizer.h"
#include "spes/data/tokenizer.h"

namespace {

std::string generated_text(int sentences) {
  const std::vector<std::string> words = {
      "the", "light", "water", "earth", "said", "and", "he", "she", "they", "over", "under",
      "mountain", "river", "people", "king", "house", "bread", "forty", "days", "nights",
      "caf\u00e9", "na\u00efve", "seven", "12", "2024", "walked", "spoke", "gave", "took"};
  std::mt19937 g(7);
  std::string text;
  for (int s = 0; s < sentences; ++s) {
    int n = 4 + g() % 10;
    for (int i = 0; i < n; ++i) {
      std::string w = words[g() % words.size()];
      if (i == 0) w[0] = static_cast<char>(std::toupper(w[0]));
      text += (i ? " " : "") + w;
    }
    text += (s % 3 == 0) ? ".\n" : (s % 3 == 1 ? "!\n" : ", and then.\n");
  }
  return text;
}

TEST(SentencePiece, TrainLoadRoundTrip) {
  spes::test::TempDir tmp;
  spes::test::write_bytes(tmp.file("a.txt"), generated_text(3000));
  spes::sentencepiece_train({tmp.file("a.txt")}, 400, tmp.file("m"), "bpe");
  auto tok = spes::tokenizer_load(tmp.file("m.model"));
  EXPECT_EQ(tok->kind(), "sentencepiece");
  EXPECT_EQ(tok->vocab_size(), 400);
  EXPECT_EQ(tok->eos_id(), 2);
  const std::vector<std::string> texts = {
      "The light said and the river walked.",
      "  two leading spaces, and   three inside  ",
      "new\nlines\n\nand\ttabs",
      "unseen characters: \u65e5\u672c\u8a9e \U0001F917 \u00e9\u00e8",
      "digits 1234567890",
      "x"};
  for (const auto& t : texts) {
    const auto ids = tok->encode(t);
    EXPECT_FALSE(ids.empty());
    for (int64_t id : ids) EXPECT_TRUE(id >= 0 && id < 400);
    EXPECT_EQ(tok->decode(ids), t);
  }
  // Common words become single pieces: far fewer ids than bytes.
  const std::string common = "The light said and the river walked over the mountain.";
  EXPECT_LT(tok->encode(common).size(), common.size() / 2);
  EXPECT_THROW(tok->decode({400}), spes::Error);
}

TEST(SentencePiece, UnigramFromSentences) {
  spes::test::TempDir tmp;
  spes::SentenceSampler sampler;
  sampler.add_lines(generated_text(2000));
  spes::sentencepiece_train_sentences(sampler.take(), 320, tmp.file("u"), "unigram");
  auto tok = spes::tokenizer_load(tmp.file("u.model"));
  EXPECT_EQ(tok->vocab_size(), 320);
  EXPECT_EQ(tok->decode(tok->encode("Seven kings gave bread.")), "Seven kings gave bread.");
}

TEST(SentencePiece, ClearErrors) {
  spes::test::TempDir tmp;
  EXPECT_THROW(spes::sentencepiece_train({tmp.file("missing.txt")}, 400, tmp.file("m"), "bpe"),
               spes::Error);
  spes::test::write_bytes(tmp.file("a.txt"), generated_text(50));
  EXPECT_THROW(spes::sentencepiece_train({tmp.file("a.txt")}, 400, tmp.file("m"), "wordpiece"),
               spes::Error);
  EXPECT_THROW(spes::sentencepiece_train({tmp.file("a.txt")}, 100, tmp.file("m"), "bpe"),
               spes::Error);  // below the 259 ids byte fallback needs
}

TEST(SentencePiece, SamplerIsDeterministicAndCapped) {
  auto run = [] {
    spes::SentenceSampler s(100, 42);
    for (int i = 0; i < 10000; ++i) s.add("line " + std::to_string(i));
    s.add("");
    EXPECT_EQ(s.seen(), 10000u);
    return s.take();
  };
  auto a = run(), b = run();
  EXPECT_EQ(a.size(), 100u);
  EXPECT_EQ(a, b);
  int late = 0;  // a uniform sample draws most lines from the later part of the stream
  for (const auto& l : a) late += std::stoi(l.substr(5)) >= 5000;
  EXPECT_GT(late, 30);
}

}  // namespace
