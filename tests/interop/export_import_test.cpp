// Export to and import from Hugging Face directories: the tensor names and shapes written are
// the documented ones (hand-written here from the transformers modules: OLMoE q_norm over the
// whole q projection, Qwen3-MoE q_norm per head), export -> import is bit-identical with
// identical logits (single file and sharded), tied embeddings are untied without changing the
// logits, and refused inputs fail with one clear error and leave nothing behind.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <set>

#include "interop/interop_test_util.h"
#include "spes/common/error.h"
#include "spes/data/tokenizer.h"
#include "spes/interop/hf_export.h"
#include "spes/interop/hf_import.h"
#include "spes/interop/hf_weights.h"
#include "spes/io/files.h"
#include "spes/train/loaded_model.h"

using namespace spes;
using json = nlohmann::json;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

namespace {

using Shapes = std::set<std::pair<std::string, std::vector<int64_t>>>;

// The tensors transformers expects for an MoE model of shape m (docs/INTEROP.md).
Shapes expected_moe_shapes(const ModelConfig& m, bool per_head_norm) {
  const int64_t D = m.d_model, V = m.vocab_size, F = m.ffn_hidden_size();
  const int64_t hd = D / m.n_heads, kv = m.kv_heads() * hd;
  Shapes s = {{"model.embed_tokens.weight", {V, D}},
              {"model.norm.weight", {D}},
              {"lm_head.weight", {V, D}}};
  for (int64_t l = 0; l < m.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    s.insert({p + "self_attn.q_proj.weight", {D, D}});
    s.insert({p + "self_attn.k_proj.weight", {kv, D}});
    s.insert({p + "self_attn.v_proj.weight", {kv, D}});
    s.insert({p + "self_attn.o_proj.weight", {D, D}});
    s.insert({p + "self_attn.q_norm.weight", {per_head_norm ? hd : D}});
    s.insert({p + "self_attn.k_norm.weight", {per_head_norm ? hd : kv}});
    s.insert({p + "input_layernorm.weight", {D}});
    s.insert({p + "post_attention_layernorm.weight", {D}});
    s.insert({p + "mlp.gate.weight", {m.moe_num_experts, D}});
    for (int64_t e = 0; e < m.moe_num_experts; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      s.insert({x + "gate_proj.weight", {F, D}});
      s.insert({x + "up_proj.weight", {F, D}});
      s.insert({x + "down_proj.weight", {D, F}});
    }
  }
  return s;
}

Shapes shapes_of(const NamedTensors& t) {
  Shapes s;
  for (const auto& [n, x] : t) s.insert({n, x.sizes().vec()});
  return s;
}

// A checkpoint of a random model of shape m (with the GPT-NeoX tokenizer when vocab allows).
std::string make_checkpoint(const interop_test::TempDir& d, const ModelConfig& m,
                            const std::string& name = "ckpt", uint64_t seed = 7) {
  auto model = interop_test::random_model(m, seed);
  const std::string dir = d.file(name);
  checkpoint_write_fresh(dir, interop_test::config_of(m), *model,
                         m.vocab_size >= 50280 ? interop_test::kNeoxTokenizer : "", false);
  return dir;
}

using interop_test::error_of;

TEST(InteropExport, OlmoeDirectoryHasTheDocumentedFilesNamesAndShapes) {
  interop_test::TempDir d;
  ModelConfig m = interop_test::tiny("moe", "whole", false, 2);
  m.vocab_size = 50304;  // the tokenizer's ids fit
  m.eos_token_id = 50279;
  m.pad_token_id = 1;
  const std::string ckpt = make_checkpoint(d, m);
  const HfExportResult r = hf_export(ckpt, d.file("hf"), {});
  EXPECT_EQ(r.architecture.architecture, "OlmoeForCausalLM");
  const std::set<std::string> files(r.files.begin(), r.files.end());
  EXPECT_EQ(files, (std::set<std::string>{"model.safetensors", "config.json",
                                          "generation_config.json", "tokenizer.json",
                                          "tokenizer_config.json", "special_tokens_map.json"}));
  for (const auto& f : files) EXPECT_TRUE(fs::exists(d.file("hf/" + f))) << f;
  Metadata meta;
  const NamedTensors t = safetensors_load(d.file("hf/model.safetensors"), &meta);
  EXPECT_EQ(meta["format"], "pt");
  EXPECT_EQ(shapes_of(t), expected_moe_shapes(m, false));
  for (const auto& [n, x] : t) EXPECT_EQ(x.scalar_type(), torch::kFloat32) << n;
  EXPECT_EQ(r.weight_bytes, static_cast<int64_t>(4 * interop_test::random_model(m, 1)->num_params()));
  const json cfg = json::parse(file_read(d.file("hf/config.json")));
  EXPECT_EQ(cfg["architectures"], json({"OlmoeForCausalLM"}));
  EXPECT_EQ(cfg["num_key_value_heads"], 2);
  const json tc = json::parse(file_read(d.file("hf/tokenizer_config.json")));
  EXPECT_EQ(tc["tokenizer_class"], "PreTrainedTokenizerFast");
  EXPECT_EQ(tc["eos_token"], "<|endoftext|>");  // ids 50279 and 1 of this vocabulary
  EXPECT_EQ(tc["pad_token"], "<|padding|>");
  EXPECT_EQ(file_read(d.file("hf/tokenizer.json")), file_read(interop_test::kNeoxTokenizer));
  const json gen = json::parse(file_read(d.file("hf/generation_config.json")));
  EXPECT_EQ(gen, json({{"_from_model_config", true}, {"eos_token_id", 50279},
                       {"pad_token_id", 1}}));
  // Nothing else is left next to the export.
  for (const auto& e : fs::directory_iterator(d.path))
    EXPECT_THAT(e.path().filename().string(), ::testing::Not(HasSubstr(".tmp.")));
}

TEST(InteropExport, SentencePieceTokenizerIsCopiedForLlamaTokenizerWithANote) {
  interop_test::TempDir d;
  std::string text;
  const std::vector<std::string> words = {"the", "river", "walked", "over", "mountain", "and",
                                          "spoke", "light", "water", "earth", "king", "house",
                                          "bread", "seven", "days", "nights", "people", "gave"};
  for (int i = 0; i < 2000; ++i)
    text += words[i % 18] + " " + words[(i * 7) % 18] + " " + std::to_string(i % 97) + " " +
            words[(i * 5 + 3) % 18] + ".\n";
  spes::test::write_bytes(d.file("a.txt"), text);
  sentencepiece_train({d.file("a.txt")}, 320, d.file("sp"), "bpe");
  ModelConfig m = interop_test::tiny();
  m.vocab_size = 320;
  m.eos_token_id = 2;  // the trained model's </s>
  auto model = interop_test::random_model(m, 2);
  checkpoint_write_fresh(d.file("ckpt"), interop_test::config_of(m), *model, d.file("sp.model"),
                         true);
  const HfExportResult r = hf_export(d.file("ckpt"), d.file("hf"), {});
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_THAT(r.notes[0], HasSubstr("no tokenizer.json was written"));
  // Every Python package that transformers' SentencePieceExtractor requires (its
  // requires_backends: sentencepiece and protobuf) is named with the command that installs it.
  EXPECT_THAT(r.notes[0], HasSubstr("pip install transformers sentencepiece protobuf"));
  EXPECT_EQ(file_read(d.file("hf/tokenizer.model")), file_read(d.file("sp.model")));
  EXPECT_FALSE(fs::exists(d.file("hf/tokenizer.json")));
  const json tc = json::parse(file_read(d.file("hf/tokenizer_config.json")));
  EXPECT_EQ(tc["tokenizer_class"], "LlamaTokenizer");
  EXPECT_EQ(tc["eos_token"], "</s>");
  EXPECT_EQ(tc["unk_token"], "<unk>");
  EXPECT_EQ(tc["add_bos_token"], false);
  // Imported back, the tokenizer.model travels with the checkpoint.
  hf_import_to_checkpoint(d.file("hf"), d.file("back"), 0, true, false);
  EXPECT_EQ(file_read(d.file("back/tokenizer.model")), file_read(d.file("sp.model")));
}

TEST(InteropExport, Qwen3MoeHasPerHeadNormsOfHeadDim) {
  interop_test::TempDir d;
  const ModelConfig m = interop_test::tiny("moe", "per_head", true, 1);
  const HfExportResult r = hf_export(make_checkpoint(d, m), d.file("hf"), {});
  EXPECT_EQ(r.architecture.architecture, "Qwen3MoeForCausalLM");
  EXPECT_EQ(shapes_of(hf_read_weights(d.file("hf"))), expected_moe_shapes(m, true));
  // No tokenizer in this checkpoint: the export says so and writes no tokenizer files.
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_THAT(r.notes[0], HasSubstr("no tokenizer found"));
  EXPECT_FALSE(fs::exists(d.file("hf/tokenizer_config.json")));
}

void expect_round_trip(const ModelConfig& m, const HfExportOptions& o, bool sharded) {
  interop_test::TempDir d;
  const std::string ckpt = make_checkpoint(d, m);
  const HfExportResult r = hf_export(ckpt, d.file("hf"), o);
  size_t shards = 0;
  for (const auto& f : r.files) shards += f.find("-of-") != std::string::npos;
  if (sharded) {
    EXPECT_GT(shards, 2u);
    EXPECT_TRUE(fs::exists(d.file("hf/model.safetensors.index.json")));
  } else {
    EXPECT_EQ(shards, 0u);
    EXPECT_TRUE(fs::exists(d.file("hf/model.safetensors")));
  }
  const HfImportResult ir =
      hf_import_to_checkpoint(d.file("hf"), d.file("back"), 0, false, false);
  EXPECT_EQ(ir.model.block_type, m.block_type);
  const LoadedModel a = load_model_from_checkpoint(ckpt);
  const LoadedModel b = load_model_from_checkpoint(d.file("back"));
  interop_test::expect_same_weights(*a.model, *b.model);
  const torch::Tensor tokens = interop_test::sample_tokens(m, m.max_sequence_length, 3);
  torch::NoGradGuard ng;
  EXPECT_TRUE(torch::equal(a.model->logits(tokens), b.model->logits(tokens)));
  // The imported checkpoint carries a fresh optimizer state (so --resume accepts it).
  const json st = json::parse(file_read(d.file("back/state.json")));
  EXPECT_TRUE(st["files"].contains("optimizer.safetensors"));
  EXPECT_EQ(st["step"], 0);
}

TEST(InteropRoundTrip, OlmoeIsBitIdenticalWithIdenticalLogits) {
  expect_round_trip(interop_test::tiny("moe", "whole", false, 2), {}, false);
}

TEST(InteropRoundTrip, Qwen3MoeShardedIsBitIdenticalWithIdenticalLogits) {
  HfExportOptions o;
  o.max_shard_bytes = 4000;  // tiny shards: many files plus the index
  expect_round_trip(interop_test::tiny("moe", "per_head", true, 1), o, true);
}

TEST(InteropRoundTrip, DenseQwen3AndLlamaAreBitIdentical) {
  expect_round_trip(interop_test::tiny("dense", "per_head", false, 2), {}, false);
  expect_round_trip(interop_test::tiny("dense", "none"), {}, false);
}

TEST(InteropRoundTrip, Bfloat16ExportReadsBackRounded) {
  interop_test::TempDir d;
  const ModelConfig m = interop_test::tiny();
  const std::string ckpt = make_checkpoint(d, m);
  HfExportOptions o;
  o.dtype = torch::kBFloat16;
  hf_export(ckpt, d.file("hf"), o);
  EXPECT_EQ(json::parse(file_read(d.file("hf/config.json")))["torch_dtype"], "bfloat16");
  hf_import_to_checkpoint(d.file("hf"), d.file("back"), 0, true, false);
  const LoadedModel a = load_model_from_checkpoint(ckpt);
  const LoadedModel b = load_model_from_checkpoint(d.file("back"));
  for (size_t i = 0; i < a.model->params().size(); ++i) {
    const torch::Tensor& x = a.model->params()[i].tensor;
    EXPECT_TRUE(torch::equal(x.to(torch::kBFloat16).to(torch::kFloat32),
                             b.model->params()[i].tensor));
  }
  EXPECT_FALSE(fs::exists(d.file("back/optimizer.safetensors")));  // weights only
}

// A hand-made Llama directory as transformers saves a tied model: no lm_head.weight, fp16
// tensors, and the rotary inv_freq buffer some older checkpoints carry.
TEST(InteropImport, TiedEmbeddingsAreUntiedWithTheSameLogits) {
  interop_test::TempDir d;
  const ModelConfig m = interop_test::tiny("dense", "none");
  auto ref = interop_test::random_model(m, 11);
  {
    torch::NoGradGuard ng;
    for (const auto& p : ref->params())  // what fp16 storage keeps
      p.tensor.copy_(p.tensor.to(torch::kFloat16).to(torch::kFloat32));
    ref->params().back().tensor.copy_(ref->params().front().tensor);  // lm_head = embed
  }
  NamedTensors t;
  for (const auto& p : ref->params())
    if (p.name != "lm_head.weight") t.emplace_back(p.name, p.tensor.to(torch::kFloat16));
  t.emplace_back("model.layers.0.self_attn.rotary_emb.inv_freq", torch::ones({2}));
  fs::create_directories(d.file("hf"));
  hf_write_weights(d.file("hf"), t, torch::kFloat16, 1 << 30);
  json cfg = hf_config_from_model(m, "float16");
  cfg["tie_word_embeddings"] = true;
  file_write_atomic(d.file("hf/config.json"), cfg.dump());
  const HfImportResult r = hf_import_to_checkpoint(d.file("hf"), d.file("ckpt"), 0, true, false);
  EXPECT_TRUE(r.tied_embeddings);
  const LoadedModel b = load_model_from_checkpoint(d.file("ckpt"));
  interop_test::expect_same_weights(*ref, *b.model);
  const torch::Tensor tokens = interop_test::sample_tokens(m, 8, 5);
  torch::NoGradGuard ng;
  EXPECT_TRUE(torch::equal(ref->logits(tokens), b.model->logits(tokens)));
}

TEST(InteropImport, RefusesBiasesUnknownAndMissingTensors) {
  interop_test::TempDir d;
  const ModelConfig m = interop_test::tiny("dense", "per_head");
  const std::string ckpt = make_checkpoint(d, m);
  hf_export(ckpt, d.file("hf"), {});
  NamedTensors good = hf_read_weights(d.file("hf"));
  auto import_with = [&](const NamedTensors& t) {
    file_write_atomic(d.file("hf/model.safetensors"), safetensors_serialize(t, {{"format", "pt"}}));
    return error_of([&] { hf_import_to_checkpoint(d.file("hf"), d.file("x"), 0, true, false); });
  };
  NamedTensors t = good;
  t.emplace_back("model.layers.0.self_attn.q_proj.bias", torch::zeros({16}));
  EXPECT_THAT(import_with(t), HasSubstr("tensor 'model.layers.0.self_attn.q_proj.bias' is a bias"));
  t = good;
  t.emplace_back("model.layers.0.mlp.shared_expert.up_proj.weight", torch::zeros({4, 16}));
  EXPECT_THAT(import_with(t), HasSubstr("'model.layers.0.mlp.shared_expert.up_proj.weight' is "
                                        "not part of this model"));
  t = good;
  t.erase(t.begin() + 3);
  EXPECT_THAT(import_with(t), HasSubstr("tensor '" + good[3].first + "' is missing"));
  t = good;
  t[2].second = t[2].second.narrow(0, 0, 2).clone();
  EXPECT_THAT(import_with(t), HasSubstr("tensor '" + good[2].first + "' has shape"));
  EXPECT_FALSE(fs::exists(d.file("x")));
}

TEST(InteropExport, RefusesExistingOutputAndLeavesNothingOnFailure) {
  interop_test::TempDir d;
  const std::string ckpt = make_checkpoint(d, interop_test::tiny("moe", "none"));
  EXPECT_THAT(error_of([&] { hf_export(ckpt, d.file("hf"), {}); }),
              HasSubstr("model.qk_norm is 'none'"));
  EXPECT_FALSE(fs::exists(d.file("hf")));
  fs::create_directories(d.file("taken"));
  const std::string ok = make_checkpoint(d, interop_test::tiny(), "ok");
  EXPECT_THAT(error_of([&] { hf_export(ok, d.file("taken"), {}); }),
              HasSubstr("already exists; choose another output directory or pass --overwrite"));
  HfExportOptions o;
  o.overwrite = true;
  hf_export(ok, d.file("taken"), o);
  EXPECT_TRUE(fs::exists(d.file("taken/config.json")));
  for (const auto& e : fs::directory_iterator(d.path))
    EXPECT_THAT(e.path().filename().string(), ::testing::Not(HasSubstr(".tmp.")));
}

}  // namespace
