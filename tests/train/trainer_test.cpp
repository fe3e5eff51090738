// The training loop end to end on a tiny model and synthetic token shards: bit-exact resume
// (N steps straight == N/2 + resume + N/2), learning a simple pattern, frozen experts staying
// untouched, and the fields of metrics.jsonl.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>

#include "spes/common/error.h"
#include "spes/io/files.h"
#include "spes/train/trainer.h"
#include "train/train_test_util.h"

namespace fs = std::filesystem;
using namespace spes;

namespace {

using spes::test::read_metrics;

Config tiny_config(const std::string& shard, int64_t steps) {
  Config c = spes::test::tiny_train_config(shard, steps);  // 2 micro-batches: accumulation
  c.model.mlp_hidden_size = 64;
  c.scheduler.t_max = 8;
  c.data.validation_fraction = 0.1;
  c.eval_interval = 4;
  c.eval_batches = 2;
  config_validate(c, "tiny");
  return c;
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
    shard_ = spes::test::make_pattern_shard(dir_ / "data", 40000, 64);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
  std::string shard_;
};

}  // namespace

// Trains 8 steps straight and 4 + resume + 4 with `threads` intra-op threads (2: the two
// micro-batches of each step run at once, train/micro_batch_workers) and expects identical
// losses, gradient norms and weights. Returns the straight run's metrics.
std::vector<nlohmann::json> expect_bit_exact_resume(
    const fs::path& dir, const std::string& shard, int64_t threads,
    const std::function<void(Config&)>& tweak = {}, const std::string& tag = "") {
  auto config = [&](int64_t steps) {
    Config c = tiny_config(shard, steps);
    c.threads = threads;
    if (tweak) tweak(c);
    return c;
  };
  const fs::path straight = dir / ("straight" + std::to_string(threads) + tag);
  const fs::path resumed = dir / ("resumed" + std::to_string(threads) + tag);
  std::string straight_sha, resumed_sha;
  {
    Trainer t(config(8), straight.string(), quiet());
    t.run();
    straight_sha = t.registry().weights_sha256();
  }
  {
    Trainer t(config(4), resumed.string(), quiet());
    t.run();
  }
  {
    Trainer t(config(8), resumed.string(), quiet("auto"));
    EXPECT_EQ(t.state().step, 4);
    t.run();
    resumed_sha = t.registry().weights_sha256();
  }
  auto a = read_metrics(straight), with_marker = read_metrics(resumed);
  // The continued run appended to the first one's lines, after a line marking the restart.
  EXPECT_EQ(with_marker.size(), 9u);
  std::vector<nlohmann::json> b;
  for (const auto& l : with_marker) {
    if (l.contains("step")) b.push_back(l);
    else EXPECT_EQ(l, with_marker.at(4));
  }
  if (with_marker.size() > 4) {
    EXPECT_EQ(with_marker[4]["event"], "restart");
    EXPECT_EQ(with_marker[4]["from_step"], 4);
  }
  EXPECT_EQ(a.size(), 8u);
  EXPECT_EQ(b.size(), 8u);
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    EXPECT_EQ(a[i]["step"], b[i]["step"]);
    EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << "step " << i + 1;
    EXPECT_EQ(a[i]["grad_norm"].get<double>(), b[i]["grad_norm"].get<double>());
  }
  EXPECT_EQ(straight_sha, resumed_sha);
  return a;
}

TEST_F(TrainerTest, ResumeIsBitExact) {
  auto m = expect_bit_exact_resume(dir_, shard_, 1);
  ASSERT_FALSE(m.empty());
  EXPECT_EQ(m[0]["memory"]["worker_grad_bytes"].get<int64_t>(), 0);
}

TEST_F(TrainerTest, ResumeIsBitExactWithMicroBatchesOnTwoThreads) {
  auto parallel = expect_bit_exact_resume(dir_, shard_, 2);
  ASSERT_FALSE(parallel.empty());
  // The second worker really had gradient buffers of its own...
  EXPECT_GT(parallel[0]["memory"]["worker_grad_bytes"].get<int64_t>(), 0);
  // ...and training matches the one-thread run up to the order of the gradient sums.
  auto serial = expect_bit_exact_resume(dir_, shard_, 1);
  ASSERT_EQ(serial.size(), parallel.size());
  for (size_t i = 0; i < serial.size(); ++i)
    EXPECT_NEAR(serial[i]["loss"].get<double>(), parallel[i]["loss"].get<double>(), 1e-4)
        << "step " << i + 1;
}

// The bf16 layout on CPU (grouped experts in bf16 stacks, frozen experts stored in bf16, chunked
// LM-head loss, activation checkpointing): resume is bit-exact there too, the loss falls, and
// the frozen experts are bf16 tensors that never change.
TEST_F(TrainerTest, Bf16LayoutWithCheckpointingResumesBitExactAndLearns) {
  auto bf16 = [](Config& c) {
    c.precision = "amp_bf16";
    c.activation_checkpointing = "whole_layer";
    c.frozen_experts = {"*:3"};
  };
  auto m = expect_bit_exact_resume(dir_, shard_, 1, bf16, "bf16");
  ASSERT_EQ(m.size(), 8u);
  EXPECT_LT(m.back()["ce"].get<double>(), m.front()["ce"].get<double>());
  Config c = tiny_config(shard_, 2);
  bf16(c);
  Trainer t(c, (dir_ / "bf16_layout").string(), quiet());
  std::map<std::string, torch::Tensor> before;
  for (const auto& e : t.registry().entries()) before[e.name] = e.tensor.detach().clone();
  t.run();
  for (const auto& e : t.registry().entries()) {
    const bool frozen = e.role == ParamRole::Expert && e.expert == 3;
    EXPECT_EQ(e.tensor.scalar_type(), frozen ? torch::kBFloat16 : torch::kFloat32) << e.name;
    if (frozen) EXPECT_TRUE(torch::equal(before[e.name], e.tensor)) << e.name;
  }
}

TEST_F(TrainerTest, LearnsAPatternAndLogsEveryField) {
  Config c = tiny_config(shard_, 40);
  c.scheduler.t_max = 40;
  Trainer t(c, (dir_ / "learn").string(), quiet());
  EvalResult r = t.run();
  auto m = read_metrics(dir_ / "learn");
  ASSERT_EQ(m.size(), 40u);
  for (const char* k : {"step", "loss", "ce", "lb_loss", "router_z_loss", "z_loss", "lr",
                        "grad_norm", "tokens", "tokens_per_s", "peak_rss_mb", "time",
                        "elapsed_s"})
    EXPECT_TRUE(m.back().contains(k)) << k;
  EXPECT_TRUE(m[3].contains("val_loss"));    // eval_interval 4
  EXPECT_FALSE(m[2].contains("val_loss"));
  EXPECT_LT(m.back()["ce"].get<double>(), m.front()["ce"].get<double>() - 1.0);
  EXPECT_LT(r.loss, std::log(64.0) - 1.0);   // far below a uniform guess
  EXPECT_TRUE(fs::exists(dir_ / "learn" / "checkpoint" / "model.safetensors"));
  // Wall clock: Unix seconds of this century, and seconds since the run started, growing.
  EXPECT_GT(m.back()["time"].get<double>(), 1.7e9);
  EXPECT_GE(m.back()["time"].get<double>(), m.front()["time"].get<double>());
  EXPECT_GE(m.back()["elapsed_s"].get<double>(), m.front()["elapsed_s"].get<double>());
  EXPECT_GT(m.front()["elapsed_s"].get<double>(), 0.0);
}

TEST_F(TrainerTest, ARunStartedAgainWithoutACheckpointKeepsTheEarlierLines) {
  const std::string out = (dir_ / "again").string();
  {
    Trainer t(tiny_config(shard_, 3), out, quiet());
    t.run();
  }
  fs::remove_all(fs::path(out) / "checkpoint");
  {
    Trainer t(tiny_config(shard_, 3), out, quiet("auto"));  // nothing to resume from
    t.run();
  }
  const auto m = read_metrics(out);
  ASSERT_EQ(m.size(), 7u);
  for (int i : {0, 1, 2, 4, 5, 6}) EXPECT_EQ(m[i]["step"], i < 3 ? i + 1 : i - 3);
  EXPECT_EQ(m[3]["event"], "restart");
  EXPECT_EQ(m[3]["from_step"], 0);
  EXPECT_EQ(m[3]["checkpoint"], "");
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

// run() queues each step before reading the previous one's figures where nothing has to see the
// weights in between (train/trainer.h); that changes when figures are read, never what is
// computed: the same losses, norms and weights as queueing and reading one step at a time, and
// a metrics line per step in order.
TEST_F(TrainerTest, StepsQueuedAheadGiveTheSameRunAsOneAtATime) {
  Config c = tiny_config(shard_, 6);
  c.eval_interval = 3;  // steps 1, 2, 4, 5 are read after the next is queued; 3 and 6 are not
  Trainer ahead(c, (dir_ / "ahead").string(), quiet());
  ahead.run();
  const auto m = read_metrics(dir_ / "ahead");
  Trainer one(c, (dir_ / "one").string(), quiet());
  ASSERT_EQ(m.size(), 6u);
  for (int64_t s = 1; s <= 6; ++s) {
    const nlohmann::json r = one.train_step();
    const nlohmann::json& a = m[s - 1];
    EXPECT_EQ(a["step"].get<int64_t>(), s);
    for (const char* k : {"loss", "ce", "lb_loss", "router_z_loss", "z_loss", "grad_norm", "lr"})
      EXPECT_EQ(a[k].get<double>(), r[k].get<double>()) << k << " at step " << s;
    EXPECT_EQ(a["tokens"], r["tokens"]);
    EXPECT_GT(a["tokens_per_s"].get<double>(), 0.0);
    EXPECT_EQ(a.contains("val_loss"), s % 3 == 0) << s;
  }
  EXPECT_EQ(ahead.registry().weights_sha256(), one.registry().weights_sha256());
  // Two steps in flight at once, read in order.
  QueuedStep q1 = one.queue_step(), q2 = one.queue_step();
  EXPECT_EQ(q1.step, 7);
  EXPECT_EQ(q2.step, 8);
  EXPECT_EQ(one.state().step, 8);
  EXPECT_TRUE(std::isfinite(one.settle_step(q1)["loss"].get<double>()));
  EXPECT_EQ(one.settle_step(q2)["step"].get<int64_t>(), 8);
}
