// The interop commands through the real binary: export-hf -> import-hf -> upcycle -> a SPES
// run (`spes launch`, a server and 2 node processes) started from the upcycled checkpoint with
// model.init_checkpoint, checked by the digest every node reports when it joins. Plus
// `spes --version`, defaults in `--help`, and one-line errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/version.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include "interop/cli_run.h"
#include "interop/interop_test_util.h"
#include "spes/common/build_features.h"
#include "spes/io/files.h"
#include "spes/train/cuda_library.h"
#include "spes/train/device.h"
#include "spes/model/ownership.h"
#include "spes/model/registry.h"
#include "spes/train/loaded_model.h"

using namespace spes;
using json = nlohmann::json;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

namespace {

TEST(InteropCli, VersionAndDefaultsInHelp) {
  interop_test::TempDir d;
  auto v = interop_test::run_spes(d, {"--version"});
  EXPECT_EQ(v.code, 0);
  // The libtorch it was built with, whether CUDA is compiled in, and the GPUs this process sees.
  const std::string head = std::string("spes ") + SPES_VERSION + " (libtorch " + TORCH_VERSION +
                           ", CPU GEMM " + (std::string(SPES_CPU_BLAS) == "openblas"
                                                ? "OpenBLAS "
                                                : "MKL (libtorch's)");
  EXPECT_EQ(v.out.rfind(head, 0), 0u) << v.out;
  const int64_t gpus = spes::cuda_device_count();
  // A build without the sync side says so last.
  const std::string tail = SPES_WITH_SYNC ? ")\n" : ", sync: no (built with SPES_WITH_SYNC=OFF))\n";
  const std::string tail_re = SPES_WITH_SYNC ? "\\)\n" : ", sync: no \\(built with SPES_WITH_SYNC=OFF\\)\\)\n";
  // libtorch_cuda is loaded only where an NVIDIA driver is (train/cuda_library.h).
  if (SPES_WITH_CUDA && spes::nvidia_driver_present())
    EXPECT_THAT(v.out, ::testing::MatchesRegex(".*, CUDA [0-9]+\\.[0-9], GPUs visible: " +
                                               std::to_string(gpus) + tail_re))
        << v.out;
  else
    EXPECT_THAT(v.out, ::testing::EndsWith(", CUDA: " + spes::torch_cuda_status() + tail))
        << v.out;
  const std::vector<std::pair<std::string, std::vector<std::string>>> want = {
      {"export-hf", {"5GB", "float32"}},
      {"import-hf", {"--max-seq-len", "0"}},
      {"upcycle", {"normal", "0.02", "true"}},
      {"score", {"--tokens"}},
      {"train", {"runs/train", "auto"}},
      {"generate", {"And God said"}}};
  for (const auto& [cmd, needles] : want) {
    auto h = interop_test::run_spes(d, {cmd, "--help"});
    EXPECT_EQ(h.code, 0) << cmd;
    for (const auto& n : needles) EXPECT_THAT(h.out, HasSubstr(n)) << cmd << "\n" << h.out;
  }
}

TEST(InteropCli, ErrorsAreOneLineOnStderr) {
  interop_test::TempDir d;
  auto r = interop_test::run_spes(d, {"import-hf", "--from", d.file("none"), "--out", d.file("x")});
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(r.err, "error: '" + d.file("none") +
                       "' is not a Hugging Face model directory (no config.json)\n");
  fs::create_directories(d.file("hf"));
  file_write_atomic(d.file("hf/config.json"), R"({"model_type": "olmo2", "hidden_size": 8})");
  r = interop_test::run_spes(d, {"import-hf", "--from", d.file("hf"), "--out", d.file("x")});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("'model_type' is \"olmo2\""));
  EXPECT_FALSE(fs::exists(d.file("x")));
}

// A small English text for `spes prepare` (the license texts every Debian system ships).
std::string write_corpus(const interop_test::TempDir& d) {
  std::ofstream out(d.file("corpus.txt"));
  for (const char* f : {"GPL-3", "Apache-2.0"}) {
    std::ifstream in(std::string("/usr/share/common-licenses/") + f);
    out << in.rdbuf() << "\n\n";
  }
  for (int i = 0; i < 200; ++i) out << "the server averages the shared weights every round.\n";
  return d.file("corpus.txt");
}

TEST(InteropEndToEnd, ExportImportUpcycleAndASpesRunFromTheUpcycledCheckpoint) {
#if !SPES_WITH_SYNC
  GTEST_SKIP() << "built with SPES_WITH_SYNC=OFF: no spes launch";
#endif
  interop_test::TempDir d;
  ModelConfig mc = interop_test::tiny("dense", "per_head", false, 2);
  mc.vocab_size = 50304;
  mc.max_sequence_length = 16;
  mc.eos_token_id = 0;
  auto dense = interop_test::random_model(mc, 31);
  checkpoint_write_fresh(d.file("dense"), interop_test::config_of(mc), *dense,
                         interop_test::kNeoxTokenizer, true);
  auto r = interop_test::run_spes(d, {"export-hf", "--checkpoint", d.file("dense"), "--out",
                                      d.file("dense_hf"), "--max-shard-size", "1MB"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("Qwen3ForCausalLM"));
  EXPECT_TRUE(fs::exists(d.file("dense_hf/model.safetensors.index.json")));
  r = interop_test::run_spes(d, {"import-hf", "--from", d.file("dense_hf"), "--out",
                                 d.file("dense_back")});
  ASSERT_EQ(r.code, 0) << r.err;
  interop_test::expect_same_weights(*load_model_from_checkpoint(d.file("dense_back")).model,
                                    *dense);
  r = interop_test::run_spes(d, {"upcycle", "--from", d.file("dense_hf"), "--experts", "4",
                                 "--top-k", "2", "--out", d.file("up"), "--noise-std", "0.01",
                                 "--noise-fraction", "0.5", "--seed", "3"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("4 experts (top-2, normalised weights)"));
  EXPECT_EQ(file_read(d.file("up/tokenizer.json")), file_read(interop_test::kNeoxTokenizer));

  // The digest of the upcycled weights, as nodes compute it (registry order, fp32 bytes).
  const LoadedModel up = load_model_from_checkpoint(d.file("up"));
  const ParamRegistry reg(*up.model, up.config, Ownership::from_config(up.config), 0);
  const std::string up_sha = reg.weights_sha256();

  r = interop_test::run_spes(d, {"prepare", "--input", write_corpus(d), "--out", d.file("tokens"),
                                 "--tokenizer", interop_test::kNeoxTokenizer});
  ASSERT_EQ(r.code, 0) << r.err;
  r = interop_test::run_spes(
      d, {"launch", "--config", d.file("up/config.yaml"), "--nodes", "2", "--out",
          d.file("run"), "--set", "model.init_checkpoint=" + d.file("up"), "--set",
          "data.paths=[" + d.file("tokens") + "]", "--set", "data.validation_fraction=0.05",
          "--set", "max_duration=4", "--set", "global_train_batch_size=2", "--set",
          "device_train_microbatch_size=2", "--set", "spes_config.sync_steps=2", "--set",
          "spes_config.merge_interval=0", "--set", "eval_interval=0", "--set", "eval_batches=1",
          "--set", "threads=1"});
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  for (int i = 0; i < 2; ++i) {
    std::ifstream metrics(d.file("run/node" + std::to_string(i) + "/metrics.jsonl"));
    std::string line;
    bool joined = false;
    while (std::getline(metrics, line)) {
      const json j = json::parse(line);
      if (!j.contains("sync_join")) continue;
      EXPECT_EQ(j["sync_join"]["model_sha256"], up_sha) << "node " << i;
      EXPECT_EQ(j["sync_join"]["round"], 0);
      // The nodes start from the server's own init checkpoint: nothing to download at join.
      EXPECT_EQ(j["sync_join"]["bytes_down"], 0) << "node " << i;
      joined = true;
    }
    EXPECT_TRUE(joined) << "node " << i << " has no sync_join record";
  }
}

}  // namespace
