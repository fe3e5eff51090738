// The training loop end to end on a tiny model and synthetic token shards: bit-exact resume
// (N steps straight == N/2 + resume + N/2), learning a simple pattern, frozen experts staying
// untouched, and the fields of metrics.jsonl.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <random>

#include "spes/common/error.h"
#include "spes/io/files.h"
#include "spes/train/trainer.h"

namespace fs = std::filesystem;
using namespace spes;

namespace {

// A raw uint32 shard (the reference format) of a noisy repeating pattern: learnable fast.
std::string make_shard(const fs::path& dir, int64_t n_tokens, int64_t vocab) {
  fs::create_directories(dir);
  std::vector<uint32_t> toks(n_tokens);
  std::mt19937 rng(3);
  for (int64_t i = 0; i < n_tokens; ++i)
    toks[i] = (rng() % 10 == 0) ? rng() % vocab : static_cast<uint32_t>((i * 7) % vocab);
  const std::string path = (dir / "tokens.bin").string();
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(toks.data()), toks.size() * 4);
  return path;
}

Config tiny_config(const std::string& shard, int64_t steps) {
  Config c;
  c.model.d_model = 32;
  c.model.n_layers = 2;
  c.model.n_heads = 2;
  c.model.mlp_hidden_size = 32;
  c.model.moe_num_experts = 4;
  c.model.moe_top_k = 2;
  c.model.vocab_size = 64;
  c.model.max_sequence_length = 16;
  c.optimizer.learning_rate = 3e-3;
  c.scheduler.t_warmup = 2;
  c.scheduler.t_max = 8;
  c.data.paths = {shard};
  c.data.validation_fraction = 0.1;
  c.max_duration = std::to_string(steps);
  c.global_train_batch_size = 8;
  c.device_train_microbatch_size = 4;  // 2 micro-batches: exercises accumulation
  c.eval_interval = 4;
  c.eval_batches = 2;
  c.threads = 1;
  c.device = "cpu";
  config_validate(c, "tiny");
  return c;
}

std::vector<nlohmann::json> read_metrics(const fs::path& dir) {
  std::vector<nlohmann::json> out;
  std::ifstream f(dir / "metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

TrainerOptions quiet(const std::string& resume = "") {
  TrainerOptions o;
  o.progress = ProgressMode::None;
  o.resume_from = resume;
  return o;
}

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("spes_trainer_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    shard_ = make_shard(dir_ / "data", 40000, 64);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
  std::string shard_;
};

}  // namespace

TEST_F(TrainerTest, ResumeIsBitExact) {
  std::string straight_sha, resumed_sha;
  {
    Trainer t(tiny_config(shard_, 8), (dir_ / "straight").string(), quiet());
    t.run();
    straight_sha = t.registry().weights_sha256();
  }
  {
    Trainer t(tiny_config(shard_, 4), (dir_ / "resumed").string(), quiet());
    t.run();
  }
  {
    Trainer t(tiny_config(shard_, 8), (dir_ / "resumed").string(), quiet("auto"));
    EXPECT_EQ(t.state().step, 4);
    t.run();
    resumed_sha = t.registry().weights_sha256();
  }
  auto a = read_metrics(dir_ / "straight"), b = read_metrics(dir_ / "resumed");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(a[i]["step"], b[i]["step"]);
    EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << "step " << i + 1;
    EXPECT_EQ(a[i]["grad_norm"].get<double>(), b[i]["grad_norm"].get<double>());
  }
  EXPECT_EQ(straight_sha, resumed_sha);
}

TEST_F(TrainerTest, LearnsAPatternAndLogsEveryField) {
  Config c = tiny_config(shard_, 40);
  c.scheduler.t_max = 40;
  Trainer t(c, (dir_ / "learn").string(), quiet());
  EvalResult r = t.run();
  auto m = read_metrics(dir_ / "learn");
  ASSERT_EQ(m.size(), 40u);
  for (const char* k : {"step", "loss", "ce", "lb_loss", "router_z_loss", "z_loss", "lr",
                        "grad_norm", "tokens", "tokens_per_s", "peak_rss_mb"})
    EXPECT_TRUE(m.back().contains(k)) << k;
  EXPECT_TRUE(m[3].contains("val_loss"));    // eval_interval 4
  EXPECT_FALSE(m[2].contains("val_loss"));
  EXPECT_LT(m.back()["ce"].get<double>(), m.front()["ce"].get<double>() - 1.0);
  EXPECT_LT(r.loss, std::log(64.0) - 1.0);   // far below a uniform guess
  EXPECT_TRUE(fs::exists(dir_ / "learn" / "checkpoint" / "model.safetensors"));
}

TEST_F(TrainerTest, FrozenExpertsStayUntouched) {
  Config c = tiny_config(shard_, 6);
  c.frozen_experts = {"*:0", "1:3"};
  Trainer t(c, (dir_ / "frozen").string(), quiet());
  std::map<std::string, torch::Tensor> before;
  for (const auto& e : t.registry().entries()) before[e.name] = e.tensor.detach().clone();
  t.run();
  for (const auto& e : t.registry().entries()) {
    const bool frozen = e.role == ParamRole::Expert &&
                        (e.expert == 0 || (e.layer == 1 && e.expert == 3));
    EXPECT_EQ(e.trainable, !frozen) << e.name;
    if (frozen) EXPECT_TRUE(torch::equal(before[e.name], e.tensor)) << e.name;
  }
  EXPECT_FALSE(torch::equal(before["lm_head.weight"], t.registry().find("lm_head.weight")->tensor));
  int64_t trainable = 0;
  for (const auto& e : t.registry().entries()) trainable += e.trainable ? e.tensor.numel() : 0;
  EXPECT_EQ(t.optimizer().state_bytes(), 2 * 4 * trainable);
  // The first metrics line records the memory actually held: fp32 gradients of the trainable
  // tensors only, and two AdamW moments each.
  const auto m = read_metrics(dir_ / "frozen");
  ASSERT_TRUE(m.front().contains("memory"));
  const auto& mem = m.front()["memory"];
  EXPECT_EQ(mem["trainable_numel"].get<int64_t>(), trainable);
  EXPECT_EQ(mem["grad_bytes"].get<int64_t>(), 4 * trainable);
  EXPECT_EQ(mem["optimizer_state_bytes"].get<int64_t>(), 8 * trainable);
  EXPECT_FALSE(m.back().contains("memory"));
}

TEST_F(TrainerTest, MissingDataIsOneClearError) {
  Config c = tiny_config(shard_, 2);
  c.data.paths = {(dir_ / "nope.bin").string()};
  try {
    Trainer t(c, (dir_ / "bad").string(), quiet());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nope.bin"), std::string::npos) << e.what();
  }
}
