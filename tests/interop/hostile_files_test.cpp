// Hostile files fed to the real binary (issue 35, finding 8): JSON nested 100,000 deep as a
// tokenizer.json (`spes tokenize`) and as a Hugging Face weight index (`spes import-hf`), which
// overflowed the stack (SIGSEGV); a YAML alias bomb as a config, which grew the process to 5 GB;
// a model far larger than the machine (`--set model.n_layers=1000000`), which allocated layer
// after layer before failing. Each now ends with the usual error exit (1), one clear line
// naming the problem, and nothing written.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>

#include "interop/cli_run.h"
#include "interop/interop_test_util.h"
#include "spes/interop/hf_config.h"
#include "spes/io/config.h"
#include "spes/io/files.h"

using namespace spes;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

namespace {

std::string deeply_nested(int depth) {
  return std::string(static_cast<size_t>(depth), '[') + std::string(static_cast<size_t>(depth), ']');
}

// Ten anchors, each a list of ten aliases of the one before: 10^10 nodes once expanded.
std::string alias_bomb() {
  std::string y = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i < 10; ++i) {
    y += "a" + std::to_string(i) + ": &a" + std::to_string(i) + " [";
    for (int k = 0; k < 10; ++k) y += (k ? ", *a" : "*a") + std::to_string(i - 1);
    y += "]\n";
  }
  return y;
}

}  // namespace

TEST(HostileFiles, ADeeplyNestedTokenizerJsonIsRefusedWithoutACrash) {
  interop_test::TempDir d;
  file_write_atomic(d.file("tokenizer.json"), "{\"model\": " + deeply_nested(100000) + "}");
  const auto r = interop_test::run_spes(d, {"tokenize", "--tokenizer", d.file("tokenizer.json"),
                                            "--text", "hello"});
  EXPECT_EQ(r.code, 1) << r.err;  // was: killed by SIGSEGV
  EXPECT_THAT(r.err, HasSubstr("nests deeper than 256 levels"));
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST(HostileFiles, ADeeplyNestedWeightIndexIsRefusedAndNothingIsWritten) {
  interop_test::TempDir d;
  fs::create_directories(d.file("hf"));
  ModelConfig m;
  m.d_model = 16;
  m.n_layers = 1;
  m.n_heads = 2;
  m.mlp_hidden_size = 32;
  m.block_type = "dense";
  m.moe_num_experts = 0;
  m.qk_norm = "none";  // a Llama
  m.vocab_size = 64;
  m.max_sequence_length = 16;
  file_write_atomic(d.file("hf/config.json"), hf_config_from_model(m, "float32").dump());
  file_write_atomic(d.file("hf/model.safetensors.index.json"),
                    "{\"weight_map\": " + deeply_nested(100000) + "}");
  const auto r = interop_test::run_spes(d, {"import-hf", "--from", d.file("hf"), "--out",
                                            d.file("out")});
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("model.safetensors.index.json: the JSON nests deeper than 256"));
  EXPECT_FALSE(fs::exists(d.file("out")));
}

TEST(HostileFiles, AYamlAliasBombIsRefusedUnloaded) {
  interop_test::TempDir d;
  file_write_atomic(d.file("bomb.yaml"), alias_bomb());
  auto r = interop_test::run_spes(d, {"config", "--config", d.file("bomb.yaml")});
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("would expand to more than 1000000 nodes"));
  // A command that would write: nothing is.
  r = interop_test::run_spes(d, {"train", "--config", d.file("bomb.yaml"), "--out",
                                 d.file("run")});
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_FALSE(fs::exists(d.file("run")));
}

TEST(HostileFiles, AModelLargerThanTheMachineIsRefusedBeforeItIsBuilt) {
  interop_test::TempDir d;
  fs::create_directories(d.file("tokens"));
  const std::string cfg = d.file("c.yaml");
  file_write_atomic(cfg, "model:\n  d_model: 512\n  n_layers: 2\n  n_heads: 8\n"
                         "  mlp_hidden_size: 1024\n  vocab_size: 512\n  max_sequence_length: 32\n"
                         "data:\n  paths: [" + d.file("tokens") + "]\n");
  // A million layers of d_model 512: about 4e12 parameters, 16 TB of fp32 weights.
  for (const char* cmd : {"train", "serve"}) {
    const auto r = interop_test::run_spes(d, {cmd, "--config", cfg, "--set",
                                              "model.n_layers=1000000", "--out", d.file("out")});
    EXPECT_EQ(r.code, 1) << cmd << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr("GiB of memory")) << cmd;
    EXPECT_THAT(r.err, HasSubstr("model.n_layers=1000000")) << cmd;
    EXPECT_FALSE(fs::exists(d.file("out"))) << cmd;
  }
}
