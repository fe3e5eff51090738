// Hugging Face transformers (from PyPI, tests/interop/transformers_reference.py) as the
// independent reference for interop, all in fp32 on CPU, per-token log-probabilities within
// 1e-4: a checkpoint exported by `spes export-hf` loads with AutoModelForCausalLM (OLMoE and
// Qwen3-MoE classes) and scores real text as `spes score` does; tiny models created and saved by
// transformers itself (OLMoE, Qwen3-MoE, Llama, Qwen3) import with `spes import-hf` and score the
// same; `spes upcycle` of a transformers-saved dense Llama or Qwen3 gives the dense logits.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "interop/cli_run.h"
#include "interop/interop_test_util.h"
#include "python_reference.h"

using namespace spes;
using json = nlohmann::json;

namespace {

constexpr double kTol = 1e-4;
const std::string kText =
    "In the beginning God created the heaven and the earth. And the earth was without form, "
    "and void; and darkness was upon the face of the deep.";
const std::string kTokens = "1,5,9,33,2,90,17,17,64,3,41";

json transformers_score(const std::string& hf_dir, const std::string& flag,
                        const std::string& value) {
  return json::parse(spes::test::run_python_reference("interop/transformers_reference.py",
                                                      {"score", hf_dir, flag, value}));
}

json spes_score(const interop_test::TempDir& d, const std::string& dir, const std::string& flag,
                const std::string& value) {
  const auto r = interop_test::run_spes(d, {"score", "--checkpoint", dir, flag, value});
  EXPECT_EQ(r.code, 0) << r.err;
  return r.code == 0 ? json::parse(r.out) : json();
}

void expect_same_scores(const json& spes_side, const json& reference, const std::string& what) {
  ASSERT_FALSE(spes_side.is_null()) << what;
  ASSERT_EQ(spes_side["tokens"], reference["tokens"]) << what;
  const auto a = spes_side["logprobs"].get<std::vector<double>>();
  const auto b = reference["logprobs"].get<std::vector<double>>();
  ASSERT_EQ(a.size(), b.size()) << what;
  ASSERT_FALSE(a.empty()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], kTol) << what << " position " << i;
}

TEST(TransformersReference, ExportedOlmoeAndQwen3MoeLoadInTransformersAndScoreTheSame) {
  struct Case {
    ModelConfig mc;
    std::string hf_class;
  };
  const std::vector<Case> cases = {
      {interop_test::tiny("moe", "whole", false, 2), "OlmoeForCausalLM"},
      {interop_test::tiny("moe", "per_head", true, 1), "Qwen3MoeForCausalLM"}};
  for (const auto& [mc0, hf_class] : cases) {
    interop_test::TempDir d;
    ModelConfig mc = mc0;
    mc.vocab_size = 50304;  // the bundled tokenizer's 50,280 ids, padded
    mc.max_sequence_length = 64;
    auto model = interop_test::random_model(mc, 11);
    checkpoint_write_fresh(d.file("ckpt"), interop_test::config_of(mc), *model,
                           interop_test::kNeoxTokenizer, true);
    const auto e = interop_test::run_spes(d, {"export-hf", "--checkpoint", d.file("ckpt"),
                                              "--out", d.file("hf")});
    ASSERT_EQ(e.code, 0) << e.err;
    const json ref = transformers_score(d.file("hf"), "--text", kText);
    EXPECT_EQ(ref["class"], hf_class);
    expect_same_scores(spes_score(d, d.file("ckpt"), "--text", kText), ref, hf_class);
  }
}

TEST(TransformersReference, TinyModelsSavedByTransformersImportAndScoreTheSame) {
  for (const std::string kind : {"olmoe", "qwen3_moe", "llama", "qwen3"}) {
    interop_test::TempDir d;
    spes::test::run_python_reference("interop/transformers_reference.py",
                                     {"make", kind, d.file("hf"), "5"});
    const json ref = transformers_score(d.file("hf"), "--tokens", kTokens);
    const auto r = interop_test::run_spes(d, {"import-hf", "--from", d.file("hf"), "--out",
                                              d.file("ckpt")});
    ASSERT_EQ(r.code, 0) << kind << ": " << r.err;
    expect_same_scores(spes_score(d, d.file("ckpt"), "--tokens", kTokens), ref,
                       kind + " imported");
    expect_same_scores(spes_score(d, d.file("hf"), "--tokens", kTokens), ref,
                       kind + " read directly");
  }
}

TEST(TransformersReference, UpcycledDenseLlamaAndQwen3GiveTheDenseModelsLogits) {
  for (const std::string kind : {"llama", "qwen3"}) {
    interop_test::TempDir d;
    spes::test::run_python_reference("interop/transformers_reference.py",
                                     {"make", kind, d.file("hf"), "9"});
    const json dense = transformers_score(d.file("hf"), "--tokens", kTokens);
    const auto r = interop_test::run_spes(
        d, {"upcycle", "--from", d.file("hf"), "--experts", "4", "--top-k", "2",
            "--norm-topk-prob", "true", "--out", d.file("moe")});
    ASSERT_EQ(r.code, 0) << kind << ": " << r.err;
    expect_same_scores(spes_score(d, d.file("moe"), "--tokens", kTokens), dense,
                       kind + " upcycled");
  }
}

}  // namespace
