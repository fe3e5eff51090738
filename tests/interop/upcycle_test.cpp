// Dense -> MoE upcycling: with normalised top-k and no noise the MoE's logits equal the dense
// model's; with raw top-k they do not (the test can fail); noise touches the requested fraction
// with the requested std, reproducibly; router inits; the two recipes (copy: the dense logits;
// reference: half the entries noised with std 0.02, routers with the std of the dense
// down_proj) and the command line; refused inputs. Then the ways a run starts
// from an upcycled checkpoint: model.init_checkpoint (a fresh model, the sync server's initial
// model) and `--resume` with its fresh optimizer state.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "interop/cli_run.h"
#include "interop/interop_test_util.h"
#include "spes/common/error.h"
#include "spes/interop/hf_export.h"
#include "spes/interop/init_checkpoint.h"
#include "spes/interop/upcycle.h"
#include "spes/sync/round/aggregate.h"
#include "spes/train/loaded_model.h"
#include "spes/train/trainer.h"

using namespace spes;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

namespace {

using interop_test::error_of;

const torch::Tensor& param(const Transformer& m, const std::string& name) {
  for (const auto& p : m.params())
    if (p.name == name) return p.tensor;
  throw std::runtime_error("no tensor " + name);
}

ModelConfig dense_config() { return interop_test::tiny("dense", "per_head", false, 2); }

TEST(InteropUpcycle, NormalisedTopKWithoutNoiseEqualsTheDenseModel) {
  auto dense = interop_test::random_model(dense_config(), 21);
  UpcycleOptions o;
  o.experts = 4;
  o.top_k = 2;
  auto moe = upcycle_model(*dense, o);
  EXPECT_EQ(moe->config().block_type, "moe");
  EXPECT_EQ(moe->config().moe_num_experts, 4);
  EXPECT_TRUE(moe->config().moe_norm_topk_prob);
  // Shared tensors copied; every expert the dense MLP (gate->W1, up->V1, down->W2).
  for (const auto& p : moe->params()) {
    if (p.role == ParamRole::Expert) {
      const std::string proj = p.name.substr(p.name.rfind("experts.") + 10);
      const std::string from = "model.layers." + std::to_string(p.layer) + ".mlp." + proj;
      EXPECT_TRUE(torch::equal(p.tensor, param(*dense, from))) << p.name << " <- " << from;
    } else if (p.name.find("mlp.gate.weight") == std::string::npos) {
      EXPECT_TRUE(torch::equal(p.tensor, param(*dense, p.name))) << p.name;
    }
  }
  const torch::Tensor router = param(*moe, "model.layers.1.mlp.gate.weight");
  EXPECT_GT(router.std().item<double>(), 0.01);
  EXPECT_LT(router.std().item<double>(), 0.04);
  const torch::Tensor tokens = interop_test::sample_tokens(dense->config(), 8, 2);
  torch::NoGradGuard ng;
  const torch::Tensor a = dense->logits(tokens), b = moe->logits(tokens);
  EXPECT_TRUE(torch::allclose(a, b, 1e-5, 1e-5)) << (a - b).abs().max().item<double>();
}

TEST(InteropUpcycle, RawTopKWeightsDoNotSumToOneSoTheLogitsDiffer) {
  auto dense = interop_test::random_model(dense_config(), 21);
  UpcycleOptions o;
  o.experts = 4;
  o.top_k = 2;
  o.norm_topk_prob = false;
  auto moe = upcycle_model(*dense, o);
  const torch::Tensor tokens = interop_test::sample_tokens(dense->config(), 8, 2);
  torch::NoGradGuard ng;
  EXPECT_GT((dense->logits(tokens) - moe->logits(tokens)).abs().max().item<double>(), 1e-3);
}

TEST(InteropUpcycle, NoiseTouchesTheRequestedFractionWithTheRequestedStd) {
  ModelConfig m = dense_config();
  m.d_model = 64;
  m.mlp_hidden_size = 192;  // F = 96
  auto dense = interop_test::random_model(m, 3);
  UpcycleOptions o;
  o.experts = 3;
  o.top_k = 1;
  o.noise_std = 0.05;
  o.noise_fraction = 0.25;
  o.seed = 9;
  auto a = upcycle_model(*dense, o);
  auto b = upcycle_model(*dense, o);
  interop_test::expect_same_weights(*a, *b);  // seeded
  const torch::Tensor base = param(*dense, "model.layers.0.mlp.up_proj.weight");
  std::vector<torch::Tensor> experts;
  for (int e = 0; e < 3; ++e) {
    const torch::Tensor w =
        param(*a, "model.layers.0.mlp.experts." + std::to_string(e) + ".up_proj.weight");
    const torch::Tensor diff = w - base;
    const torch::Tensor changed = diff != 0;
    const double frac = changed.to(torch::kFloat64).mean().item<double>();
    EXPECT_NEAR(frac, 0.25, 0.02) << "expert " << e;  // 6144 entries: 4 sigma ~ 0.022
    EXPECT_NEAR(diff.masked_select(changed).std().item<double>(), 0.05, 0.005);
    experts.push_back(w);
  }
  EXPECT_FALSE(torch::equal(experts[0], experts[1]));  // each copy gets its own noise
  o.seed = 10;
  auto c = upcycle_model(*dense, o);
  EXPECT_FALSE(torch::equal(param(*a, "model.layers.0.mlp.experts.0.up_proj.weight"),
                            param(*c, "model.layers.0.mlp.experts.0.up_proj.weight")));
}

TEST(InteropUpcycle, RouterInits) {
  ModelConfig m = dense_config();
  m.d_model = 64;
  auto dense = interop_test::random_model(m, 3);
  UpcycleOptions o;
  o.experts = 64;
  o.top_k = 2;
  o.router_init = "zeros";
  EXPECT_EQ(param(*upcycle_model(*dense, o), "model.layers.0.mlp.gate.weight")
                .abs().max().item<double>(), 0.0);
  o.router_init = "scaled_normal";  // std 1/sqrt(64) = 0.125 over 4096 draws
  EXPECT_NEAR(param(*upcycle_model(*dense, o), "model.layers.0.mlp.gate.weight")
                  .std().item<double>(), 0.125, 0.01);
  o.router_init = "normal";
  o.router_std = 0.5;
  EXPECT_NEAR(param(*upcycle_model(*dense, o), "model.layers.0.mlp.gate.weight")
                  .std().item<double>(), 0.5, 0.04);
}

// The reference recipe (its 9B model from Qwen3-1.7B): N(0, 0.02^2) on exactly half of the
// entries of each expert's gate, up and down matrices, a fresh draw for every matrix of every
// expert, seeded; each router drawn with the std of its layer's dense down_proj.
TEST(InteropUpcycle, ReferenceRecipeNoiseIsHalfTheEntriesWithStd002) {
  ModelConfig m = dense_config();
  m.d_model = 64;
  m.set_ffn_hidden_size(96);  // 6144 entries per matrix
  auto dense = interop_test::random_model(m, 3);
  {  // a zero dense MLP, so that an expert minus its source is the noise itself, unrounded
    torch::NoGradGuard ng;
    for (const auto& p : dense->params())
      if (p.name.find(".mlp.") != std::string::npos) p.tensor.zero_();
  }
  UpcycleOptions o = upcycle_recipe("reference");
  EXPECT_EQ(o.recipe, "reference");
  EXPECT_DOUBLE_EQ(o.noise_std, 0.02);
  EXPECT_DOUBLE_EQ(o.noise_fraction, 0.5);
  EXPECT_EQ(o.router_init, "down_proj_std");
  EXPECT_TRUE(o.norm_topk_prob);
  o.experts = 3;
  o.top_k = 2;
  o.seed = 4;
  auto a = upcycle_model(*dense, o);
  std::vector<torch::Tensor> noises;
  for (int64_t l = 0; l < m.n_layers; ++l)
    for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
      const torch::Tensor base =
          param(*dense, "model.layers." + std::to_string(l) + ".mlp." + proj + ".weight");
      for (int64_t e = 0; e < 3; ++e) {
        SCOPED_TRACE(std::to_string(l) + " " + proj + " " + std::to_string(e));
        const torch::Tensor diff = param(*a, expert_param_name(l, e, proj)) - base;
        const torch::Tensor changed = diff != 0;
        EXPECT_EQ(changed.sum().item<int64_t>(), base.numel() / 2);  // exactly half
        // 3072 draws: the sample std's standard error is 0.02 / sqrt(6144) = 0.00026, so the
        // tolerance 0.001 is ~4 sigma (the mean's: 0.00036, tolerance ~5.5 sigma).
        EXPECT_NEAR(diff.masked_select(changed).std().item<double>(), 0.02, 0.001);
        EXPECT_NEAR(diff.masked_select(changed).mean().item<double>(), 0.0, 0.002);
        noises.push_back(diff);
      }
    }
  // A fresh draw for every matrix of every expert (positions and values).
  for (size_t i = 0; i < noises.size(); ++i)
    for (size_t j = i + 1; j < noises.size(); ++j)
      if (noises[i].sizes() == noises[j].sizes())
        EXPECT_FALSE(torch::equal(noises[i] != 0, noises[j] != 0)) << i << " " << j;
  // Seeded: the same seed gives the same model, another seed another one.
  interop_test::expect_same_weights(*a, *upcycle_model(*dense, o));
  o.seed = 5;
  EXPECT_FALSE(torch::equal(param(*a, expert_param_name(0, 0, "up_proj")),
                            param(*upcycle_model(*dense, o), expert_param_name(0, 0, "up_proj"))));
}

TEST(InteropUpcycle, ReferenceRecipeRouterHasTheStdOfTheDenseDownProjection) {
  ModelConfig m = dense_config();
  m.d_model = 64;
  auto dense = interop_test::random_model(m, 3);
  {  // layers with clearly different down_proj spreads: 0.3 and 0.9
    torch::NoGradGuard ng;
    const_cast<torch::Tensor&>(param(*dense, "model.layers.1.mlp.down_proj.weight")).mul_(3.0);
  }
  UpcycleOptions o = upcycle_recipe("reference");
  o.experts = 64;  // 64 x 64 router entries per layer
  o.top_k = 2;
  auto moe = upcycle_model(*dense, o);
  for (int64_t l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".mlp.";
    const double down_std = param(*dense, p + "down_proj.weight").std().item<double>();
    const torch::Tensor router = param(*moe, p + "gate.weight");
    // 4096 draws: relative error of the sample std ~1.1%; 4% is ~3.5 sigma.
    EXPECT_NEAR(router.std().item<double>(), down_std, 0.04 * down_std) << "layer " << l;
    EXPECT_NEAR(router.mean().item<double>(), 0.0, 0.06 * down_std) << "layer " << l;
  }
}

TEST(InteropUpcycle, CopyRecipeGivesTheDenseLogitsAndTheReferenceRecipeDoesNot) {
  auto dense = interop_test::random_model(dense_config(), 21);
  const torch::Tensor tokens = interop_test::sample_tokens(dense->config(), 8, 2);
  torch::NoGradGuard ng;
  UpcycleOptions copy = upcycle_recipe("copy");
  EXPECT_DOUBLE_EQ(copy.noise_std, 0.0);
  copy.experts = 4;
  copy.top_k = 2;
  const torch::Tensor want = dense->logits(tokens);
  const torch::Tensor got = upcycle_model(*dense, copy)->logits(tokens);
  EXPECT_TRUE(torch::allclose(want, got, 1e-5, 1e-5)) << (want - got).abs().max().item<double>();
  UpcycleOptions ref = upcycle_recipe("reference");
  ref.experts = 4;
  ref.top_k = 2;
  EXPECT_GT((want - upcycle_model(*dense, ref)->logits(tokens)).abs().max().item<double>(), 1e-3);
  EXPECT_THAT(error_of([] { upcycle_recipe("noisy"); }),
              HasSubstr("--recipe must be copy (exact copies of the dense MLP) or reference"));
}

TEST(InteropUpcycle, CommandLineRecipeAndOverrides) {
  interop_test::TempDir d;
  auto dense = interop_test::random_model(dense_config(), 7);
  checkpoint_write_fresh(d.file("dense"), interop_test::config_of(dense_config()), *dense, "",
                         true);
  auto r = interop_test::run_spes(d, {"upcycle", "--from", d.file("dense"), "--experts", "4",
                                      "--top-k", "2", "--recipe", "reference", "--noise-std",
                                      "0.05", "--seed", "3", "--out", d.file("up")});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("(recipe reference)"));
  EXPECT_THAT(r.out, HasSubstr("noise std 0.05 on a fraction 0.5 of each expert matrix, router "
                               "down_proj_std"));
  // The library with the same options gives the same checkpoint.
  UpcycleOptions o = upcycle_recipe("reference");
  o.experts = 4;
  o.top_k = 2;
  o.noise_std = 0.05;
  o.seed = 3;
  interop_test::expect_same_weights(*load_model_from_checkpoint(d.file("up")).model,
                                    *upcycle_model(*dense, o));
  r = interop_test::run_spes(d, {"upcycle", "--from", d.file("dense"), "--experts", "4",
                                 "--top-k", "2", "--out", d.file("up2")});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("(recipe copy)"));
  EXPECT_THAT(r.out, HasSubstr("noise std 0 on a fraction 0"));
}

TEST(InteropUpcycle, RefusesMoeSourcesAndBadOptions) {
  auto moe = interop_test::random_model(interop_test::tiny(), 1);
  UpcycleOptions o;
  EXPECT_THAT(error_of([&] { upcycle_model(*moe, o); }),
              HasSubstr("the source is already an MoE model"));
  auto dense = interop_test::random_model(dense_config(), 1);
  o.top_k = 9;
  EXPECT_THAT(error_of([&] { upcycle_model(*dense, o); }), HasSubstr("--top-k must be in [1, "));
  o.top_k = 2;
  o.noise_fraction = 1.5;
  EXPECT_THAT(error_of([&] { upcycle_model(*dense, o); }), HasSubstr("--noise-fraction"));
  o.noise_fraction = 0;
  o.router_init = "uniform";
  EXPECT_THAT(error_of([&] { upcycle_model(*dense, o); }),
              HasSubstr("--router-init must be normal, scaled_normal, zeros or down_proj_std, "
                        "found 'uniform'"));
}

// A raw uint32 token shard (the reference format) for the training checks.
std::string make_shard(const fs::path& dir, int64_t vocab) {
  std::vector<uint32_t> toks(4096);
  std::mt19937 rng(3);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<uint32_t>((i * 7 + rng() % 3) % vocab);
  const std::string path = (dir / "tokens.bin").string();
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(toks.data()), static_cast<std::streamsize>(toks.size() * 4));
  return path;
}

class InteropUpcycledRun : public ::testing::Test {
 protected:
  void SetUp() override {
    dense_ = interop_test::random_model(dense_config(), 5);
    // Through a Hugging Face directory, as a user would: dense checkpoint -> HF -> upcycle.
    checkpoint_write_fresh(d_.file("dense"), interop_test::config_of(dense_config()), *dense_,
                           "", true);
    hf_export(d_.file("dense"), d_.file("dense_hf"), {});
    UpcycleOptions o;
    o.experts = 4;
    o.top_k = 2;
    o.seed = 1;
    upcycle_to_checkpoint(d_.file("dense_hf"), d_.file("up"), o, 0, false, false);
    up_ = load_model_from_checkpoint(d_.file("up"));
  }
  interop_test::TempDir d_;
  std::unique_ptr<Transformer> dense_;
  LoadedModel up_;
};

TEST_F(InteropUpcycledRun, CheckpointHasTheMoeConfigAndComputesTheDenseModel) {
  const Config c = up_.config;
  EXPECT_EQ(c.model.block_type, "moe");
  EXPECT_EQ(c.model.moe_num_experts, 4);
  EXPECT_TRUE(c.model.moe_norm_topk_prob);
  EXPECT_EQ(c.spes_config.mode, "centralized");
  const torch::Tensor tokens = interop_test::sample_tokens(c.model, 8, 4);
  torch::NoGradGuard ng;
  EXPECT_TRUE(torch::allclose(dense_->logits(tokens), up_.model->logits(tokens), 1e-5, 1e-5));
}

TEST_F(InteropUpcycledRun, InitCheckpointKeyStartsAFreshModelAndTheSyncServerFromIt) {
  Config c = up_.config;
  c.model.init_checkpoint = d_.file("up");
  const std::optional<InitialWeights> initial = init_checkpoint_weights(c.model);
  ASSERT_TRUE(initial.has_value());
  Transformer fresh(c.model, torch::kCPU);
  fresh.init_weights(123, &*initial);
  interop_test::expect_same_weights(fresh, *up_.model);
  // The sync server's initial model (what every SPES node downloads when it joins).
  c.spes_config.mode = "spes";
  c.spes_config.num_peers = 2;
  sync::SyncModel server(c, init_checkpoint_weights(c.model));
  const NamedTensors published = server.named();
  ASSERT_EQ(published.size(), up_.model->params().size());
  for (size_t i = 0; i < published.size(); ++i)
    EXPECT_TRUE(torch::equal(published[i].second, up_.model->params()[i].tensor))
        << published[i].first;
  // An HF directory works as init_checkpoint too (the dense export, for a dense run).
  Config dc = interop_test::config_of(dense_config());
  dc.model.init_checkpoint = d_.file("dense_hf");
  Transformer fresh_dense(dc.model, torch::kCPU);
  const std::optional<InitialWeights> dense_initial = init_checkpoint_weights(dc.model);
  fresh_dense.init_weights(1, &*dense_initial);
  interop_test::expect_same_weights(fresh_dense, *dense_);
  // Without a key there is nothing to read (the seeded random init).
  dc.model.init_checkpoint.clear();
  EXPECT_FALSE(init_checkpoint_weights(dc.model).has_value());
}

TEST_F(InteropUpcycledRun, AModelNamingAnInitCheckpointNeedsItsWeightsHandedDown) {
  // A program that builds the model from such a config without reading the directory (the
  // command's step) is refused rather than silently starting from random weights.
  Config c = up_.config;
  c.model.init_checkpoint = d_.file("up");
  Transformer t(c.model, torch::kCPU);
  EXPECT_THAT(error_of([&] { t.init_weights(1); }),
              HasSubstr("model.init_checkpoint is '" + d_.file("up") +
                        "' but this model was given no initial weights"));
  EXPECT_THAT(error_of([&] { sync::SyncModel server(c); }),
              HasSubstr("given no initial weights"));
}

TEST_F(InteropUpcycledRun, InitCheckpointRefusesAnotherArchitecture) {
  Config c = up_.config;
  c.model.init_checkpoint = d_.file("up");
  c.model.moe_top_k = 1;
  Transformer t(c.model, torch::kCPU);
  const std::optional<InitialWeights> initial = init_checkpoint_weights(c.model);
  EXPECT_THAT(error_of([&] { t.init_weights(1, &*initial); }),
              HasSubstr("model.moe_top_k is 1 in this run's config but 2 in the initial weights"));
  c.model.moe_top_k = 2;
  c.model.init_checkpoint = d_.file("missing");
  EXPECT_THAT(error_of([&] { init_checkpoint_weights(c.model); }),
              HasSubstr("is not a directory"));
}

TEST_F(InteropUpcycledRun, TrainingResumesFromItAndStartsFromItWithInitCheckpoint) {
  Config c = up_.config;
  c.data.paths = {make_shard(d_.path, c.model.vocab_size)};
  c.data.validation_fraction = 0;
  c.max_duration = "2";
  c.global_train_batch_size = 2;
  c.device_train_microbatch_size = 2;
  c.threads = 1;
  c.device = "cpu";
  c.eval_interval = 0;
  {
    TrainerOptions o;
    o.resume_from = d_.file("up");
    o.progress = ProgressMode::None;
    Trainer t(c, d_.file("run_resume"), o);
    EXPECT_EQ(t.state().step, 0);
    interop_test::expect_same_weights(t.model(), *up_.model);
    t.run();
    EXPECT_EQ(t.state().step, 2);
  }
  c.model.init_checkpoint = d_.file("up");
  TrainerOptions o;
  o.progress = ProgressMode::None;
  Trainer t(c, d_.file("run_init"), o, init_checkpoint_weights(c.model));
  interop_test::expect_same_weights(t.model(), *up_.model);
}

}  // namespace
