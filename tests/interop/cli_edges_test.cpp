// Edges of the command line that a new user meets first: a mistyped command names the nearest
// one, and counts out of range (--nodes -3, --nproc-per-node 0, --node-id -1, a stop timeout
// of 0) are refused by option name before anything runs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "interop/cli_run.h"

using spes::interop_test::run_spes;
using ::testing::HasSubstr;

namespace {

TEST(CliEdges, AMistypedCommandNamesTheNearestOne) {
  spes::test::TempDir tmp;
  const auto r = run_spes(tmp, {"trian", "--config", "x.yaml"});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("error: 'trian' is not a spes command (did you mean 'train'?); "
                               "`spes --help` lists the commands"));
  const auto far = run_spes(tmp, {"xyzzy"});
  EXPECT_EQ(far.code, 1);
  EXPECT_THAT(far.err, HasSubstr("'xyzzy' is not a spes command; `spes --help`"));
}

TEST(CliEdges, CountsOutOfRangeAreRefusedByOptionName) {
  spes::test::TempDir tmp;
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"launch", "--nodes", "-3", "--out", tmp.file("l")}, "--nodes"},
      {{"launch", "--nproc-per-node", "0", "--out", tmp.file("l")}, "--nproc-per-node"},
      {{"launch", "--stop-timeout", "0", "--out", tmp.file("l")}, "--stop-timeout"},
      {{"train", "--nproc-per-node", "0", "--out", tmp.file("t")}, "--nproc-per-node"},
      {{"train", "--checkpoint-every", "-1", "--out", tmp.file("t")}, "--checkpoint-every"},
      {{"node", "--node-id", "-1", "--out", tmp.file("n")}, "--node-id"},
  };
  for (const auto& [args, option] : cases) {
    const auto r = run_spes(tmp, args);
    EXPECT_NE(r.code, 0) << args[1];
    EXPECT_THAT(r.err + r.out, HasSubstr(option)) << args[1];
    EXPECT_FALSE(std::filesystem::exists(tmp.file("l")) || std::filesystem::exists(tmp.file("t")) ||
                 std::filesystem::exists(tmp.file("n")))
        << "nothing may be written: " << args[1];
  }
}

TEST(CliEdges, ConfigPrintsNumbersAsWritten) {
  spes::test::TempDir tmp;
  const auto r = run_spes(tmp, {"config", "--set", "optimizer.weight_decay=0.1", "--set",
                                "max_duration=300", "--set", "model.layer_norm_eps=1e-6"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("weight_decay: 0.1\n"));
  EXPECT_THAT(r.out, HasSubstr("max_duration: 300\n"));
  EXPECT_THAT(r.out, HasSubstr("layer_norm_eps: 1e-06\n"));
  EXPECT_THAT(r.out, HasSubstr("betas: [0.9, 0.95]"));
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("0000000")));
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("\"300\"")));
}

TEST(CliEdges, AMissingRelativeDataPathNamesWhereItLooked) {
  spes::test::TempDir tmp;
  // The default config's data.paths (data/bible-tokens) is relative: from another directory
  // than the repository's root the error says where it looked.
  const auto r = run_spes(tmp, {"train", "--out", tmp.file("t"), "--set", "max_duration=1"});
  EXPECT_EQ(r.code, 1);
  const std::string cwd = std::filesystem::current_path().string();
  EXPECT_THAT(r.err, HasSubstr("token shard 'data/bible-tokens' does not exist (looked for " +
                               cwd + "/data/bible-tokens, relative to the working directory " +
                               cwd + ")"));
}

}  // namespace
