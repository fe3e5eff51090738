// `spes train` stopped by a signal, with real processes: SIGINT mid-run writes OUT/checkpoint
// at the step it stopped after, prints how to continue and exits 130, and continuing from that
// checkpoint gives the same weights and moments, byte for byte, as a run never interrupted;
// SIGTERM exits 143; a second signal exits at once leaving only complete files;
// --checkpoint-every writes checkpoints while the run goes on, so kill -9 loses little.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>

#include "spes/io/files.h"
#include "sync/sync_process_util.h"
#include "train/train_test_util.h"

using namespace spes;
using namespace spes::sync::testing;
namespace fs = std::filesystem;

namespace {

class TrainStop : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / ("spes_stop_" + std::to_string(::getpid()) + "_" +
                                         std::to_string(std::random_device{}())))
               .string();
    const std::string shard = spes::test::make_pattern_shard(dir_ + "/data", 40000, 64);
    cfg_ = dir_ + "/config.yaml";
    // The LR schedule does not depend on max_duration (t_max fixed), so that a run continued
    // to a step is the same run as one that went there at once.
    std::ofstream(cfg_)
        << "model:\n  d_model: 32\n  n_layers: 1\n  n_heads: 2\n  mlp_hidden_size: 64\n"
           "  moe_num_experts: 4\n  moe_top_k: 2\n  vocab_size: 64\n  max_sequence_length: 16\n"
           "optimizer:\n  learning_rate: 0.003\n"
           "scheduler:\n  t_warmup: 5\n  t_max: 1000\n"
           "data:\n  paths: [" << shard << "]\n  validation_fraction: 0.05\n"
           "global_train_batch_size: 2\ndevice_train_microbatch_size: 2\neval_interval: 0\n"
           "eval_batches: 1\nthreads: 1\n";
  }
  void TearDown() override {
    std::error_code ec;
    if (!HasFailure()) fs::remove_all(dir_, ec);
  }
  std::unique_ptr<Proc> train(const std::string& out, int64_t steps,
                              const std::vector<std::string>& extra = {}) {
    std::vector<std::string> argv = {SPES_BINARY, "train", "--config", cfg_, "--out", out,
                                     "--progress", "lines", "--no-summary", "--set",
                                     "max_duration=" + std::to_string(steps)};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return std::make_unique<Proc>("train", argv);
  }
  // Runs to the end; returns the exit code.
  int run_to_end(Proc& p) {
    EXPECT_TRUE(pump_until({&p}, [&] { return p.exited; }, 300)) << p.log();
    return p.code;
  }
  // Waits until OUT/metrics.jsonl holds at least n lines.
  bool wait_for_steps(Proc& p, const std::string& out, size_t n) {
    return pump_until({&p}, [&] {
      // (whole lines only: the last one may be being written)
      const std::string text = read_or_empty(out + "/metrics.jsonl");
      return p.exited || static_cast<size_t>(std::count(text.begin(), text.end(), '\n')) >= n;
    }, 300) && !p.exited;
  }
  std::string dir_, cfg_;
};

// The step lines of OUT/metrics.jsonl (without the line a restart adds).
std::vector<nlohmann::json> step_lines(const std::string& out) {
  std::vector<nlohmann::json> lines;
  for (const auto& l : spes::test::read_metrics(out))
    if (l.contains("step")) lines.push_back(l);
  return lines;
}

int64_t checkpoint_step(const std::string& out) {
  return nlohmann::json::parse(file_read(out + "/checkpoint/state.json"))["step"];
}

TEST_F(TrainStop, SigintCheckpointsAndTheContinuedRunEqualsAnUninterruptedOne) {
  const std::string a = dir_ + "/a", b = dir_ + "/b";
  auto p = train(a, 1000000, {"--checkpoint-every", "0"});
  ASSERT_TRUE(wait_for_steps(*p, a, 4)) << p->log();
  p->p->kill(SIGINT);
  ASSERT_EQ(run_to_end(*p), 130) << p->log();
  EXPECT_TRUE(p->saw("stopped by SIGINT")) << p->log();
  EXPECT_TRUE(p->saw("to continue from " + a + "/checkpoint run:")) << p->log();
  EXPECT_TRUE(p->saw("spes train --config")) << p->log();
  // The checkpoint holds the last step the metrics show: nothing trained was lost.
  const auto lines = spes::test::read_metrics(a);
  const int64_t k = checkpoint_step(a);
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines.back()["step"].get<int64_t>(), k);
  EXPECT_GE(k, 4);

  // Continued to k + 4 steps (metrics appended), and a fresh run to k + 4 steps.
  auto cont = train(a, k + 4);
  ASSERT_EQ(run_to_end(*cont), 0) << cont->log();
  auto fresh = train(b, k + 4);
  ASSERT_EQ(run_to_end(*fresh), 0) << fresh->log();
  const auto all = step_lines(a);
  std::vector<int64_t> steps;
  for (const auto& l : all) steps.push_back(l["step"]);
  ASSERT_EQ(steps.size(), static_cast<size_t>(k + 4));
  for (int64_t i = 0; i < k + 4; ++i) EXPECT_EQ(steps[i], i + 1);
  const auto ref = step_lines(b);
  ASSERT_EQ(ref.size(), all.size());
  for (size_t i = 0; i < ref.size(); ++i)
    EXPECT_EQ(all[i]["loss"].get<double>(), ref[i]["loss"].get<double>()) << "step " << i + 1;
  for (const char* f : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_EQ(file_read(a + "/checkpoint/" + f), file_read(b + "/checkpoint/" + f)) << f;
}

TEST_F(TrainStop, SigtermExits143AndASecondSignalExitsAtOnceLeavingCompleteFiles) {
  const std::string a = dir_ + "/a", b = dir_ + "/b";
  auto p = train(a, 1000000, {"--checkpoint-every", "0"});
  ASSERT_TRUE(wait_for_steps(*p, a, 3)) << p->log();
  p->p->kill(SIGTERM);
  ASSERT_EQ(run_to_end(*p), 143) << p->log();
  EXPECT_TRUE(p->saw("stopped by SIGTERM")) << p->log();
  EXPECT_EQ(checkpoint_step(a), spes::test::read_metrics(a).back()["step"].get<int64_t>());

  // Two signals back to back: the second ends the process without waiting for the step.
  auto q = train(b, 1000000, {"--checkpoint-every", "0"});
  ASSERT_TRUE(wait_for_steps(*q, b, 3)) << q->log();
  q->p->kill(SIGINT);
  q->p->kill(SIGINT);
  ASSERT_EQ(run_to_end(*q), 130) << q->log();
  // Whatever was written is whole: every metrics line parses (read_metrics throws otherwise),
  // and a checkpoint directory, when there is one, is complete and loads.
  EXPECT_NO_THROW(spes::test::read_metrics(b));
  if (fs::exists(b + "/checkpoint")) {
    const int64_t k = checkpoint_step(b);
    auto cont = train(b, k + 1);
    EXPECT_EQ(run_to_end(*cont), 0) << cont->log();
  }
}

TEST_F(TrainStop, CheckpointEveryKeepsACheckpointThatKillNineCannotTake) {
  const std::string a = dir_ + "/a";
  // Every step is "due": checkpoints are written while the run goes on.
  auto p = train(a, 1000000, {"--checkpoint-every", "0.000001"});
  ASSERT_TRUE(pump_until({p.get()}, [&] {
    try {
      return p->exited || checkpoint_step(a) >= 3;
    } catch (const std::exception&) {  // not written yet, or being replaced
      return false;
    }
  }, 300)) << p->log();
  ASSERT_FALSE(p->exited) << p->log();
  p->kill9();
  // Killed while replacing it, the checkpoint is still whole under checkpoint.old, which the
  // next run takes back.
  const int64_t k = fs::exists(a + "/checkpoint/state.json")
                        ? checkpoint_step(a)
                        : nlohmann::json::parse(file_read(a + "/checkpoint.old/state.json"))["step"]
                              .get<int64_t>();
  EXPECT_GE(k, 3);
  auto cont = train(a, k + 2);
  ASSERT_EQ(run_to_end(*cont), 0) << cont->log();
  EXPECT_EQ(checkpoint_step(a), k + 2);
}

TEST_F(TrainStop, ASecondWriterOfTheDirectoryIsRefusedWithTheHoldersPidAndCommandLine) {
  const std::string a = dir_ + "/a";
  auto p = train(a, 1000000, {"--checkpoint-every", "0"});
  ASSERT_TRUE(wait_for_steps(*p, a, 2)) << p->log();
  const std::string text = read_or_empty(a + "/metrics.jsonl");
  const size_t lines_before = static_cast<size_t>(std::count(text.begin(), text.end(), '\n'));
  auto second = train(a, 10);
  EXPECT_EQ(run_to_end(*second), 1) << second->log();
  EXPECT_TRUE(second->saw("'" + a + "' is being written by process " +
                          std::to_string(p->p->pid()) + " (" + SPES_BINARY + " train --config"))
      << second->log();
  // The first run was not disturbed: its metrics still grow from where they were.
  ASSERT_TRUE(wait_for_steps(*p, a, lines_before + 2)) << p->log();
  p->p->kill(SIGINT);
  EXPECT_EQ(run_to_end(*p), 130) << p->log();
}

}  // namespace
