// The join check walks the must-match table (sync/round/join_settings.h): for every row, a
// node that differs from the server in that one setting, that leaves it out, or that adds a
// key the server does not know is refused with the setting's name; real configs that differ
// in a row's setting are refused naming that row; and the honest node joins.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "spes/sync/round/join_settings.h"
#include "spes/sync/server/round_state.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;
using ::testing::HasSubstr;

TEST(JoinSettings, EveryRowRefusesANodeThatDiffersInItAlone) {
  TempDir tmp;
  const Config cfg = tiny_config();
  RoundState st(cfg, {tmp.path, false});
  const FakeNode good(cfg, 0, 1);
  ASSERT_EQ(good.join_info().settings.size(), kJoinSettings.size());
  for (const JoinSetting& row : kJoinSettings) {
    const std::string key(row.key);
    JoinInfo differs = good.join_info();
    differs.settings.at(key) += "-other";
    EXPECT_THAT(error_of([&] { st.join(differs); }), HasSubstr(key + "=")) << key;
    EXPECT_THAT(error_of([&] { st.join(differs); }), HasSubstr(std::string(row.fix))) << key;
    EXPECT_EQ(code_of([&] { st.join(differs); }), SyncErrc::FailedPrecondition) << key;
    JoinInfo missing = good.join_info();
    missing.settings.erase(key);
    EXPECT_THAT(error_of([&] { st.join(missing); }), HasSubstr("does not declare " + key))
        << key;
  }
  JoinInfo extra = good.join_info();
  extra.settings["spes_config.some_future_setting"] = "1";
  EXPECT_THAT(error_of([&] { st.join(extra); }),
              HasSubstr("declares the setting 'spes_config.some_future_setting'"));
  EXPECT_EQ(st.join(good.join_info()).published_round, 0);
}

TEST(JoinSettings, ConfigsThatDifferAreRefusedNamingTheRow) {
  TempDir tmp;
  RoundState st(tiny_config(), {tmp.path, false});
  const struct {
    std::string set, key;
  } cases[] = {
      {"spes_config.num_peers=4", "spes_config.num_peers="},
      {"spes_config.max_nodes=3", "spes_config.max_nodes=3"},
      {"spes_config.sync_steps=5", "spes_config.sync_steps=5"},
      {"spes_config.transfer_dtype=bf16", "spes_config.transfer_dtype=bf16"},
      {"spes_config.compression=int8", "spes_config.compression=int8"},
      {"spes_config.expert_owners=[[1,1,0,0]]", "ownership="},
      {"model.mlp_hidden_size=16", "model="},
      {"model.moe_top_k=1", "model_config="},
  };
  for (const auto& c : cases) {
    const FakeNode node(tiny_config({c.set}), 0, 1);
    EXPECT_THAT(error_of([&] { st.join(node.join_info()); }), HasSubstr(c.key)) << c.set;
  }
  JoinInfo old = FakeNode(tiny_config(), 0, 1).join_info();
  old.protocol_version = kProtocolVersion - 1;
  EXPECT_THAT(error_of([&] { st.join(old); }), HasSubstr("protocol version"));
}

// The top-k settings (protocol 7): compared exactly under compression topk (a node with
// another density, bits or decay is refused naming it), "unused" and so equal otherwise.
TEST(JoinSettings, TopkSettingsMustMatchOnlyUnderTopk) {
  const std::string fp = "model-fingerprint";
  auto values = [&](std::vector<std::string> sets) {
    const Config cfg = tiny_config(std::move(sets));
    return join_setting_values(JoinSources{cfg, fp});
  };
  const JoinSettingValues server = values({"spes_config.compression=topk"});
  EXPECT_EQ(server.at("spes_config.topk_density"), "0.015625");
  EXPECT_EQ(server.at("spes_config.topk_bits"), "2");
  EXPECT_EQ(server.at("spes_config.topk_decay"), "1");
  EXPECT_EQ(server.at("spes_config.topk_down_density"), "0.015625");  // 0: topk_density's
  check_join_settings(0, values({"spes_config.compression=topk"}), server);
  const struct {
    std::string set, key;
  } cases[] = {
      {"spes_config.topk_density=0.02", "spes_config.topk_density=0.02"},
      {"spes_config.topk_bits=3", "spes_config.topk_bits=3"},
      {"spes_config.topk_decay=0.95", "spes_config.topk_decay=0.94999999999999996"},
      {"spes_config.topk_down_density=0.0625", "spes_config.topk_down_density=0.0625"},
  };
  for (const auto& c : cases)
    EXPECT_THAT(error_of([&] {
                  check_join_settings(0, values({"spes_config.compression=topk", c.set}),
                                      server);
                }),
                HasSubstr(c.key))
        << c.set;
  // Under int8 the top-k settings are not used, so nodes need not agree on them.
  const JoinSettingValues int8 = values({"spes_config.compression=int8"});
  EXPECT_EQ(int8.at("spes_config.topk_density"), "unused");
  check_join_settings(0, values({"spes_config.compression=int8", "spes_config.topk_bits=4"}),
                      int8);
}
