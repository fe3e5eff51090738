// Config loading: defaults, reference key names, --set overrides, and one clear error per
// kind of bad input (unknown key with suggestion, wrong type, inconsistent sizes, bad YAML).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "spes/common/error.h"
#include "spes/io/config.h"

using namespace spes;
using ::testing::HasSubstr;

static std::string error_of(const std::string& yaml, std::vector<std::string> sets = {}) {
  try {
    config_parse(yaml, sets, "test.yaml");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Config, ReadsReferenceKeysAndOverrides) {
  Config c = config_parse(
      "model:\n  d_model: 64\n  n_heads: 4\n  n_layers: 2\n  moe_num_experts: 4\n"
      "optimizer:\n  learning_rate: 0.001\n  betas: [0.9, 0.99]\n"
      "spes_config:\n  num_peers: 2\n  sync_steps: 10\n  mode: spes\n"
      "max_duration: 50ba\n",
      {"model.d_model=128", "spes_config.peer_id=1"}, "test.yaml");
  EXPECT_EQ(c.model.d_model, 128);
  EXPECT_EQ(c.model.n_layers, 2);
  EXPECT_DOUBLE_EQ(c.optimizer.learning_rate, 0.001);
  EXPECT_DOUBLE_EQ(c.optimizer.betas[1], 0.99);
  EXPECT_EQ(c.spes_config.peer_id, 1);
  EXPECT_EQ(c.total_steps(), 50);
}

TEST(Config, TokenDurationRoundsUpToSteps) {
  Config c = config_parse("max_duration: 1000T\nglobal_train_batch_size: 2\n"
                          "device_train_microbatch_size: 1\nmodel:\n  max_sequence_length: 64\n",
                          {}, "t");
  EXPECT_EQ(c.total_steps(), 8);  // 1000 / 128 rounded up
}

TEST(Config, DurationsInOlmosNotation) {
  auto steps = [](const std::string& d) {
    return config_parse("max_duration: " + d + "\nglobal_train_batch_size: 2\n"
                        "device_train_microbatch_size: 1\nmodel:\n  max_sequence_length: 64\n",
                        {}, "t").total_steps();
  };
  EXPECT_EQ(steps("2e5T"), 1563);  // 200000 / 128 rounded up; OLMo writes tokens this way
  EXPECT_EQ(steps("1e4"), 10000);
  EXPECT_EQ(steps("500ba"), 500);
  EXPECT_THAT(error_of("max_duration: -5\n"), HasSubstr("max_duration '-5'"));
  EXPECT_THAT(error_of("max_duration: 3ep\n"), HasSubstr("'ep', are not supported"));
}

TEST(Config, YamlRoundTrip) {
  Config c = config_parse("", {"model.d_model=96", "model.n_heads=3", "data.paths=[a, b]",
                               "spes_config.expert_owners=[[0,0,1,1],[1,1,0,0]]",
                               "model.n_layers=2", "model.moe_num_experts=4",
                               "spes_config.num_peers=2"},
                          "t");
  Config d = config_parse(config_to_yaml(c), {}, "t2");
  EXPECT_EQ(config_to_yaml(c), config_to_yaml(d));
  EXPECT_EQ(d.model.d_model, 96);
  ASSERT_EQ(d.data.paths.size(), 2u);
  ASSERT_EQ(d.spes_config.expert_owners.size(), 2u);
  EXPECT_EQ(d.spes_config.expert_owners[1][0], 1);
}

TEST(Config, UnknownKeySuggestsNearest) {
  EXPECT_THAT(error_of("model:\n  d_modle: 5\n"),
              HasSubstr("unknown key 'model.d_modle' (did you mean 'model.d_model'?)"));
  EXPECT_THAT(error_of("", {"optimizer.learning_rat=1"}),
              HasSubstr("did you mean 'optimizer.learning_rate'"));
}

TEST(Config, WrongTypeNamesKeyAndExpectation) {
  EXPECT_THAT(error_of("model:\n  d_model: large\n"),
              HasSubstr("key 'model.d_model' must be an integer, found 'large'"));
}

TEST(Config, InconsistentSizes) {
  EXPECT_THAT(error_of("model:\n  d_model: 100\n  n_heads: 3\n"),
              HasSubstr("must be divisible by model.n_heads"));
  EXPECT_THAT(error_of("global_train_batch_size: 6\ndevice_train_microbatch_size: 4\n"),
              HasSubstr("must be a multiple of device_train_microbatch_size"));
  EXPECT_THAT(error_of("model:\n  moe_top_k: 9\n"), HasSubstr("moe_top_k must be in [1"));
  EXPECT_THAT(error_of("max_duration: soon\n"), HasSubstr("max_duration 'soon'"));
}

TEST(Config, OverlapSettingsAreChecked) {
  const Config c = config_parse("spes_config:\n  sync_steps: 20\n  overlap: true\n"
                                "  overlap_delay_steps: 5\n", {}, "t.yaml");
  EXPECT_TRUE(c.spes_config.timing.overlap);
  EXPECT_EQ(c.spes_config.timing.overlap_delay_steps, 5);
  EXPECT_FALSE(config_parse("", {}, "t.yaml").spes_config.timing.overlap);
  EXPECT_THAT(error_of("spes_config:\n  sync_steps: 20\n  overlap: true\n"
                       "  overlap_delay_steps: 20\n"),
              HasSubstr("spes_config.overlap_delay_steps must be in [0, sync_steps=20)"));
  EXPECT_THAT(error_of("spes_config:\n  overlap_delay_steps: 3\n"),
              HasSubstr("needs spes_config.overlap: true"));
  EXPECT_THAT(error_of("spes_config:\n  overlap: sometimes\n"), HasSubstr("spes_config.overlap"));
}

// The outer step: mode diloco always (every tensor), mode spes with outer_step (shared tensors).
TEST(Config, WireCodingFollowsCompressionUnlessSet) {
  auto codes = [](const std::string& yaml) {
    return config_parse("spes_config:\n" + yaml, {}, "t.yaml").spes_config.transfer.codes_chunks();
  };
  EXPECT_FALSE(codes("  compression: none\n"));  // auto: fp32 transfers go raw
  EXPECT_TRUE(codes("  compression: int8\n"));
  EXPECT_TRUE(codes("  compression: bf16\n"));
  EXPECT_TRUE(codes("  compression: none\n  wire_coding: zstd\n"));
  EXPECT_FALSE(codes("  compression: int8\n  wire_coding: raw\n"));
  EXPECT_THAT(error_of("spes_config:\n  wire_coding: gzip\n"),
              HasSubstr("must be auto, zstd or raw, found 'gzip'"));
}

TEST(Config, OuterStepSettingsAreChecked) {
  EXPECT_FALSE(config_parse("spes_config:\n  mode: spes\n", {}, "t.yaml")
                   .spes_config.uses_outer_step());
  EXPECT_TRUE(config_parse("spes_config:\n  mode: spes\n  outer_step: true\n", {}, "t.yaml")
                  .spes_config.uses_outer_step());
  EXPECT_TRUE(config_parse("spes_config:\n  mode: diloco\n", {}, "t.yaml")
                  .spes_config.uses_outer_step());
  EXPECT_FALSE(config_parse("spes_config:\n  mode: fedavg\n", {}, "t.yaml")
                   .spes_config.uses_outer_step());
  EXPECT_THAT(error_of("spes_config:\n  mode: fedavg\n  outer_step: true\n"),
              HasSubstr("with an outer step is mode diloco"));
  EXPECT_THAT(error_of("spes_config:\n  mode: diloco\n  outer_step: true\n"),
              HasSubstr("drop outer_step"));
  EXPECT_THAT(error_of("spes_config:\n  mode: spes\n  outer_step: true\n  outer_momentum: 1\n"),
              HasSubstr("outer_momentum in [0, 1)"));
  EXPECT_THAT(error_of("spes_config:\n  mode: diloco\n  outer_lr: 0\n"),
              HasSubstr("outer_lr > 0"));
}

TEST(Config, MalformedYamlGivesLine) {
  EXPECT_THAT(error_of("model:\n  d_model: [1, 2\n"), HasSubstr("malformed YAML at line"));
}

TEST(Config, MissingFile) {
  try {
    config_load("/nonexistent/x.yaml");
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("/nonexistent/x.yaml"));
  }
}

TEST(Config, IgnoresReferenceOnlyKeys) {
  Config c = config_parse("wandb:\n  project: x\nmodel:\n  flash_attention: true\n", {}, "t");
  EXPECT_EQ(c.model.d_model, ModelConfig().d_model);
}

namespace spes {
namespace {

TEST(ConfigBuiltinDefault, IsConfigsDefaultYaml) {
  // The compiled-in default and the file in the repository are the same config.
  const Config builtin = config_load("");
  const Config file = config_load(std::string(SPES_SOURCE_DIR) + "/configs/default.yaml");
  EXPECT_EQ(config_to_yaml(builtin), config_to_yaml(file));
  EXPECT_EQ(builtin.spes_config.mode, "spes");
  // OLMo's mlp_hidden_size is the SwiGLU width: 1024 gives experts of hidden size 512.
  EXPECT_EQ(builtin.model.mlp_hidden_size, 1024);
  EXPECT_EQ(builtin.model.ffn_hidden_size(), 512);
  EXPECT_EQ(config_load("", {"model.d_model=64"}).model.d_model, 64);
}

}  // namespace
}  // namespace spes
