// TensorBoard event files (src/spes/io/tensorboard_writer.h): CRC-32C against the published
// check values (RFC 3720's, and "123456789" of the CRC catalogue), a record framed by hand
// byte for byte, and a `spes train` run's event file read back by the `tensorboard` package
// from PyPI (its EventAccumulator and its record reader, which checks every CRC): the scalars
// and steps are metrics.jsonl's. The server's: SyncEndToEnd.LaunchRunsAClusterAndSummarises.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "interop/cli_run.h"
#include "io/tensorboard_read_back.h"
#include "spes/io/crc32c.h"
#include "spes/io/tensorboard_writer.h"
#include "train/train_test_util.h"

using namespace spes;
using spes::interop_test::run_spes;
using spes::test::TempDir;
namespace fs = std::filesystem;

TEST(Crc32c, KnownCheckValues) {
  EXPECT_EQ(crc32c(""), 0u);
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);                 // the catalogue's check value
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);       // RFC 3720, B.4
  EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62A8AB43u);     // RFC 3720, B.4
  std::string inc;
  for (int i = 0; i < 32; ++i) inc.push_back(static_cast<char>(i));
  EXPECT_EQ(crc32c(inc), 0x46DD794Eu);                         // RFC 3720, B.4
  // TFRecord's mask: rotate right by 15, add 0xa282ead8.
  const uint32_t c = 0xE3069283u;
  EXPECT_EQ(masked_crc32c("123456789"), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(TensorBoardWriter, RecordFramingAndEventBytes) {
  const std::string data = "abc";
  const std::string rec = tfrecord_frame(data);
  ASSERT_EQ(rec.size(), 8u + 4u + 3u + 4u);
  EXPECT_EQ(rec.substr(0, 8), std::string("\x03\0\0\0\0\0\0\0", 8));
  const uint32_t len_crc = masked_crc32c(rec.substr(0, 8));
  EXPECT_EQ(rec.substr(8, 4), std::string(reinterpret_cast<const char*>(&len_crc), 4));
  EXPECT_EQ(rec.substr(12, 3), "abc");
  const uint32_t data_crc = masked_crc32c("abc");
  EXPECT_EQ(rec.substr(15, 4), std::string(reinterpret_cast<const char*>(&data_crc), 4));
  // Event{wall_time: 1.5, step: 300, summary{value{tag: "a", simple_value: 2}}}, by hand:
  // 09 <double 1.5> 10 <varint 300 = ac 02> 2a 0a [0a 08 [0a 01 'a' 15 <float 2.0>]].
  const std::string want = std::string("\x09\0\0\0\0\0\0\xf8\x3f\x10\xac\x02\x2a\x0a\x0a\x08"
                                       "\x0a\x01\x61\x15\0\0\0\x40", 24);
  EXPECT_EQ(encode_scalar_event(1.5, 300, {{"a", 2.0}}), want);
}

TEST(TensorBoardWriter, UnwritableDirectoryIsRefusedNamingThePath) {
  try {
    TensorBoardWriter w("/nonexistent_spes_dir/run");
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent_spes_dir/run/events.out.tfevents."),
              std::string::npos) << e.what();
  }
}

TEST(TensorBoardEvents, TrainScalarsReadBackByTensorBoardAreMetricsJsonl) {
  TempDir d;
  const std::string shard = spes::test::make_pattern_shard(d.path, 20000, 64);
  const std::string cfg = d.file("config.yaml");
  std::ofstream(cfg) << "model:\n  d_model: 32\n  n_layers: 2\n  n_heads: 2\n"
                        "  mlp_hidden_size: 32\n  moe_num_experts: 4\n  moe_top_k: 2\n"
                        "  vocab_size: 64\n  max_sequence_length: 16\n"
                        "scheduler:\n  t_warmup: 2\n"
                        "data:\n  paths: [" << shard << "]\n  validation_fraction: 0.1\n"
                        "max_duration: 6\nglobal_train_batch_size: 4\n"
                        "device_train_microbatch_size: 4\neval_interval: 3\neval_batches: 2\n"
                        "device: cpu\nthreads: 1\n";
  const std::string out = d.file("run");
  auto r = run_spes(d, {"train", "--config", cfg, "--out", out, "--progress", "none",
                        "--no-summary"});
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  const nlohmann::json tb = spes::test::read_tensorboard(out);
  if (tb.contains("skip")) GTEST_SKIP() << "tensorboard is not installed: " << tb["skip"];
  EXPECT_EQ(tb["files"], 1);
  EXPECT_EQ(tb["file_version"], "brain.Event:2");
  EXPECT_EQ(tb["records"], 7);  // the file version, then one event per step
  EXPECT_TRUE(tb["corrupt_detected"].get<bool>());
  const auto lines = spes::test::read_metrics(out);
  ASSERT_EQ(lines.size(), 6u);
  EXPECT_TRUE(spes::test::scalars_equal_lines(
      tb, lines, {{"loss", "train/loss"}, {"lr", "train/lr"}, {"tokens_per_s", "train/tokens_per_s"},
                  {"grad_norm", "train/grad_norm"}, {"val_loss", "eval/loss"},
                  {"val_ppl", "eval/perplexity"}, {"ce", "train/ce"}}));
  EXPECT_EQ(tb["scalars"]["eval/loss"].size(), 2u);  // steps 3 and 6

  // Continued (more steps): a second file beside the first; TensorBoard reads both in order.
  auto r2 = run_spes(d, {"train", "--config", cfg, "--out", out, "--progress", "none",
                         "--no-summary", "--set", "max_duration=8"});
  ASSERT_EQ(r2.code, 0) << r2.err << r2.out;
  const nlohmann::json tb2 = spes::test::read_tensorboard(out);
  EXPECT_EQ(tb2["files"], 2);
  std::vector<nlohmann::json> steps;
  for (const auto& l : spes::test::read_metrics(out))
    if (l.contains("loss")) steps.push_back(l);
  ASSERT_EQ(steps.size(), 8u);
  EXPECT_TRUE(spes::test::scalars_equal_lines(tb2, steps, {{"loss", "train/loss"}}));
}
