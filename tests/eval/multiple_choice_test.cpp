// Multiple-choice scoring: a choice's score equals the log-likelihood of its continuation
// computed independently (one unpadded forward per choice, token by token), and the request
// reader groups choices by document.
#include <gtest/gtest.h>
#include <zlib.h>

#include <filesystem>

#include "model/tiny_model_config.h"
#include "spes/eval/multiple_choice.h"

using namespace spes;

namespace {
// Characters as token ids (mod 32): enough to exercise tokenization-independent scoring.
class CharTokenizer : public Tokenizer {
 public:
  std::vector<int64_t> encode(const std::string& t) const override {
    std::vector<int64_t> ids;
    for (unsigned char c : t) ids.push_back(c % 32);
    return ids;
  }
  std::string decode(const std::vector<int64_t>&) const override { return ""; }
  int64_t vocab_size() const override { return 32; }
  int64_t eos_id() const override { return 0; }
  std::string kind() const override { return "chars"; }
};
}  // namespace

TEST(MultipleChoice, ScoresEqualIndependentLogLikelihood) {
  Transformer m(spes::testing::tiny_model_config());
  m.init_weights(5);
  CharTokenizer tok;
  McDocument doc;
  doc.choices = {{"ab", "cd"}, {"ab", "efg"}, {"abc", "h"}};
  std::vector<int64_t> ntok;
  const auto got = mc_choice_logprobs(m, tok, doc, &ntok);
  ASSERT_EQ(got.size(), 3u);
  torch::NoGradGuard ng;
  for (size_t i = 0; i < 3; ++i) {
    auto ctx = tok.encode(doc.choices[i].context), cont = tok.encode(doc.choices[i].continuation);
    std::vector<int64_t> seq(ctx);
    seq.insert(seq.end(), cont.begin(), cont.end());
    torch::Tensor lp = torch::log_softmax(
        m.logits(torch::tensor(seq, torch::kInt64).unsqueeze(0))[0], -1);
    double expect = 0;
    for (size_t t = ctx.size(); t < seq.size(); ++t) expect += lp[t - 1][seq[t]].item<double>();
    EXPECT_NEAR(got[i], expect, 1e-4) << "choice " << i;
    EXPECT_EQ(ntok[i], static_cast<int64_t>(cont.size()));
  }
}

TEST(MultipleChoice, ReadsRequestsGroupedByDocument) {
  const std::string path = (std::filesystem::temp_directory_path() / "spes_mc_test.jsonl.gz");
  const std::string lines =
      R"({"doc_id": 1, "idx": 1, "label": 0, "request": {"context": "Q2", "continuation": " y"}})"
      "\n"
      R"({"doc_id": 0, "idx": 0, "label": 1, "request": {"context": "Q", "continuation": " a"}})"
      "\n"
      R"({"doc_id": 0, "idx": 1, "label": 1, "request": {"context": "Q", "continuation": " b"}})"
      "\n"
      R"({"doc_id": 1, "idx": 0, "label": 0, "request": {"context": "Q2", "continuation": " x"}})"
      "\n";
  gzFile f = gzopen(path.c_str(), "wb");
  gzwrite(f, lines.data(), lines.size());
  gzclose(f);
  auto docs = mc_read_requests(path);
  std::filesystem::remove(path);
  ASSERT_EQ(docs.size(), 2u);
  EXPECT_EQ(docs[0].gold, 1);
  EXPECT_EQ(docs[0].choices[1].continuation, " b");
  EXPECT_EQ(docs[1].choices[0].continuation, " x");
  EXPECT_EQ(docs[1].choices[1].context, "Q2");
}
