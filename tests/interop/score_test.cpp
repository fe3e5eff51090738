// Scoring: score_tokens against log-softmax computed here from the model's logits (a separate
// logsumexp in double), `spes score` printing exactly one JSON object on stdout for a
// checkpoint and for its Hugging Face export (same numbers), token ids given directly, errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>

#include "interop/cli_run.h"
#include "interop/interop_test_util.h"
#include "spes/common/error.h"
#include "spes/data/tokenizer.h"
#include "spes/interop/hf_export.h"
#include "spes/interop/score.h"

using namespace spes;
using json = nlohmann::json;
using ::testing::HasSubstr;

namespace {

// log p(tokens[i+1] | ..) from the logits, by hand: logit - max - log(sum exp(logit - max)).
std::vector<double> reference_logprobs(const Transformer& m, const std::vector<int64_t>& ids) {
  torch::NoGradGuard ng;
  const auto T = static_cast<int64_t>(ids.size());
  const torch::Tensor logits =
      m.logits(torch::tensor(ids, torch::kInt64).view({1, T}))[0].to(torch::kFloat64).contiguous();
  const int64_t V = logits.size(1);
  const double* L = logits.data_ptr<double>();
  std::vector<double> out;
  for (int64_t i = 0; i + 1 < T; ++i) {
    const double* row = L + i * V;
    double mx = row[0];
    for (int64_t v = 1; v < V; ++v) mx = std::max(mx, row[v]);
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(row[v] - mx);
    out.push_back(row[ids[i + 1]] - mx - std::log(sum));
  }
  return out;
}

void expect_close(const std::vector<double>& a, const std::vector<double>& b, double tol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], tol) << "position " << i;
}

TEST(InteropScore, MatchesAnIndependentLogSoftmax) {
  auto m = interop_test::random_model(interop_test::tiny("moe", "whole", false, 2), 4);
  const std::vector<int64_t> ids = {5, 0, 31, 7, 7, 2, 19, 30};
  const std::vector<double> lp = score_tokens(*m, ids);
  EXPECT_EQ(lp.size(), ids.size() - 1);
  expect_close(lp, reference_logprobs(*m, ids), 1e-9);
  for (double x : lp) EXPECT_LT(x, 0.0);
  EXPECT_TRUE(score_tokens(*m, {4}).empty());
}

TEST(InteropScore, RefusesBadInput) {
  auto m = interop_test::random_model(interop_test::tiny(), 4);
  auto err = [&](const std::vector<int64_t>& ids) {
    try {
      score_tokens(*m, ids);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_THAT(err({1, 32}), HasSubstr("token id 32 is outside the vocabulary [0, 32)"));
  EXPECT_THAT(err(std::vector<int64_t>(9, 1)),
              HasSubstr("9 tokens exceed model.max_sequence_length 8"));
  EXPECT_THAT(err({}), HasSubstr("no tokens"));
}

TEST(InteropScore, CliPrintsOneJsonObjectForACheckpointAndItsExport) {
  interop_test::TempDir d;
  ModelConfig mc = interop_test::tiny("moe", "per_head", true, 1);
  mc.vocab_size = 50304;
  mc.max_sequence_length = 32;
  auto model = interop_test::random_model(mc, 8);
  checkpoint_write_fresh(d.file("ckpt"), interop_test::config_of(mc), *model,
                         interop_test::kNeoxTokenizer, true);
  hf_export(d.file("ckpt"), d.file("hf"), {});
  const std::string text = "Hello world, the model scores this.";
  const std::vector<int64_t> ids = tokenizer_load(interop_test::kNeoxTokenizer)->encode(text);
  const std::vector<double> want = reference_logprobs(*model, ids);
  for (const std::string dir : {d.file("ckpt"), d.file("hf")}) {
    const auto r = interop_test::run_spes(d, {"score", "--checkpoint", dir, "--text", text});
    ASSERT_EQ(r.code, 0) << r.err;
    const json j = json::parse(r.out);  // throws on anything but one JSON value
    ASSERT_TRUE(j.is_object());
    EXPECT_EQ(j.size(), 2u);
    EXPECT_EQ(j["tokens"].get<std::vector<int64_t>>(), ids);
    expect_close(j["logprobs"].get<std::vector<double>>(), want, 1e-9);
  }
  const auto r = interop_test::run_spes(d, {"score", "--checkpoint", d.file("hf"), "--tokens",
                                            "12,7,50279"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["tokens"], json({12, 7, 50279}));
  expect_close(j["logprobs"].get<std::vector<double>>(),
               reference_logprobs(*model, {12, 7, 50279}), 1e-9);
  const auto bad = interop_test::run_spes(d, {"score", "--checkpoint", d.file("nowhere"),
                                              "--text", "x"});
  EXPECT_EQ(bad.code, 1);
  EXPECT_TRUE(bad.out.empty());
  EXPECT_THAT(bad.err, HasSubstr("is not a directory"));
}

}  // namespace
