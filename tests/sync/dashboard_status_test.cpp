// What the sync server's dashboard shows, from its real state: heartbeats carry each node's
// loss, throughput and loss curve (RoundState, and over gRPC to `spes status`'s client); the
// status JSON (dashboard_status) has every node, the published rounds with bytes, alpha,
// duration, missing nodes and per-layer similarity, and the loss curves; the round history
// survives a server restart; SyncServer writes the dashboard's URL into server.json, and
// dashboard_port -1 turns it off. The page itself is checked in headless Chromium by
// scripts/test_dashboard.sh (CTest: dashboard_headless_chromium).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "spes/io/files.h"
#include "spes/sync/node/client.h"
#include "spes/sync/server/dashboard_status.h"
#include "spes/sync/server/server.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;
using ::testing::ElementsAre;

namespace {

NodeMetrics metrics(double loss, double tps, std::vector<LossPoint> losses) {
  NodeMetrics m;
  m.loss = loss;
  m.tokens_per_s = tps;
  m.losses = std::move(losses);
  return m;
}

TEST(DashboardStatus, NodesRoundsAndLossCurvesFromTheServerState) {
  TempDir tmp;
  const Config cfg = tiny_config({"run_name=dash", "spes_config.merge_interval=10",
                                  "spes_config.merge_alpha_start=0.1",
                                  "spes_config.merge_topk=1"}, /*layers=*/2);
  FakeNode n0(cfg, 0, 11), n1(cfg, 1, 22);
  {
    RoundState st(cfg, {tmp.path});
    // Before anything happened: every node listed, nothing reported yet.
    nlohmann::json j = dashboard_status(cfg, st, 1.5);
    EXPECT_EQ(j["run_name"], "dash");
    EXPECT_EQ(j["mode"], "spes");
    EXPECT_EQ(j["num_peers"], 2);
    EXPECT_EQ(j["sync_steps"], 10);
    EXPECT_EQ(j["uptime_s"], 1.5);
    ASSERT_EQ(j["nodes"].size(), 2u);
    EXPECT_EQ(j["nodes"][1]["state"], "not_joined");
    EXPECT_TRUE(j["nodes"][1]["loss"].is_null());
    EXPECT_TRUE(j["nodes"][1]["last_seen_s"].is_null());
    EXPECT_TRUE(j["rounds"].empty());
    EXPECT_TRUE(j["loss"].empty());

    for (FakeNode* n : {&n0, &n1}) {
      st.join(n->join_info());
      n->download(st, 0, Selection::All);
    }
    st.heartbeat(n0.id, 4, metrics(5.5, 1200, {{1, 7.0}, {2, 6.5}, {3, 6.0}, {4, 5.5}}));
    st.heartbeat(n1.id, 2, metrics(6.25, 900, {{1, 7.1}, {2, 6.25}}));
    st.heartbeat(n1.id, 3, {});  // a heartbeat without metrics keeps the last ones
    const ServerStatus s = st.status();
    EXPECT_EQ(s.nodes[0].loss, 5.5);
    EXPECT_EQ(s.nodes[0].tokens_per_s, 1200);
    EXPECT_EQ(s.nodes[1].loss, 6.25);
    EXPECT_EQ(s.nodes[1].step, 3);

    // Round 1 (step 10, a merge point): node 1 uploads, node 0 leaves; both download.
    ASSERT_TRUE(send_upload(st, n1.id, 1, n1.upload(1)).accepted);
    st.leave(n0.id, 9, "test");
    ASSERT_TRUE(st.wait_round(n1.id, 1, 10).published);
    j = dashboard_status(cfg, st, 2);
    ASSERT_EQ(j["rounds"].size(), 1u);
    nlohmann::json r = j["rounds"][0];
    EXPECT_EQ(r["round"], 1);
    EXPECT_EQ(r["step"], 10);
    EXPECT_THAT(r["nodes"].get<std::vector<int64_t>>(), ElementsAre(1));
    EXPECT_EQ(r["missing"][0]["node"], 0);
    EXPECT_EQ(r["missing"][0]["reason"], "left");
    EXPECT_EQ(r["bytes_in"].get<uint64_t>(), n1.upload(1).total_bytes());
    EXPECT_FALSE(r.contains("bytes_out"));  // downloads still running
    EXPECT_GT(r["alpha"].get<double>(), 0);
    EXPECT_GE(r["seconds"].get<double>(), 0);
    ASSERT_EQ(r["gate_cos"].size(), 2u);  // one value per layer
    EXPECT_TRUE(std::isfinite(r["gate_cos"][1].get<double>()));
    EXPECT_EQ(r["gate_cos_before"].size(), 2u);
    const uint64_t down = n1.download(st, 1, Selection::ForNode);
    j = dashboard_status(cfg, st, 3);
    EXPECT_EQ(j["rounds"][0]["bytes_out"].get<uint64_t>(), down);  // the line, now complete
    EXPECT_EQ(j["published_round"], 1);
    EXPECT_EQ(j["published_step"], 10);
    EXPECT_EQ(j["collecting_round"], 2);

    EXPECT_EQ(j["nodes"][0]["state"], "left");
    EXPECT_EQ(j["nodes"][1]["state"], "training");
    EXPECT_EQ(j["nodes"][1]["loss"], 6.25);
    EXPECT_EQ(j["nodes"][1]["tokens_per_s"], 900);
    EXPECT_LT(j["nodes"][1]["last_seen_s"].get<double>(), 60);
    EXPECT_EQ(j["loss"]["0"], nlohmann::json::parse("[[1,7.0],[2,6.5],[3,6.0],[4,5.5]]"));
    EXPECT_EQ(j["loss"]["1"], nlohmann::json::parse("[[1,7.1],[2,6.25]]"));
    st.close();
  }
  // A restarted server shows the rounds of the run so far (from rounds.jsonl).
  RoundState again(cfg, {tmp.path});
  const nlohmann::json j = dashboard_status(cfg, again, 0);
  ASSERT_EQ(j["rounds"].size(), 1u);
  EXPECT_EQ(j["rounds"][0]["round"], 1);
  EXPECT_EQ(j["rounds"][0]["gate_cos"].size(), 2u);
}

TEST(DashboardStatus, HeartbeatMetricsTravelOverGrpcAndServerJsonNamesTheDashboard) {
  TempDir tmp;
  const Config cfg = tiny_config();
  ServerOptions o;
  o.state.out_dir = tmp.path + "/srv";
  SyncServer server(cfg, o);
  ASSERT_FALSE(server.dashboard_url().empty());  // on by default, on a free loopback port
  EXPECT_EQ(server.dashboard_url().rfind("http://127.0.0.1:", 0), 0u) << server.dashboard_url();
  EXPECT_EQ(nlohmann::json::parse(file_read(o.state.out_dir + "/server.json"))["dashboard"],
            server.dashboard_url());

  FakeNode n0(cfg, 0, 1);
  SyncClient client(server.address(), n0.id);
  client.join(n0.join_info());
  EXPECT_TRUE(std::isnan(client.status().nodes[0].loss));  // nothing reported yet
  client.heartbeat(7, metrics(3.75, 2048, {{6, 3.8}, {7, 3.75}}));
  const ServerStatus s = client.status();
  EXPECT_EQ(s.nodes[0].step, 7);
  EXPECT_EQ(s.nodes[0].loss, 3.75);
  EXPECT_EQ(s.nodes[0].tokens_per_s, 2048);
  EXPECT_TRUE(std::isnan(s.nodes[1].loss));
  const auto curves = server.state().loss_history();
  ASSERT_EQ(curves[0].size(), 2u);
  EXPECT_EQ(curves[0][1].step, 7);
  EXPECT_EQ(curves[0][1].loss, 3.75);

  // dashboard_port -1: no status page, and server.json says nothing about one.
  ServerOptions off = o;
  off.state.out_dir = tmp.path + "/off";
  SyncServer quiet(tiny_config({"spes_config.dashboard_port=-1"}), off);
  EXPECT_TRUE(quiet.dashboard_url().empty());
  EXPECT_FALSE(nlohmann::json::parse(file_read(off.state.out_dir + "/server.json"))
                   .contains("dashboard"));
}

TEST(DashboardStatus, ConfigKeysAreValidated) {
  EXPECT_THROW(tiny_config({"spes_config.dashboard_port=-2"}), Error);
  EXPECT_THROW(tiny_config({"spes_config.dashboard_port=70000"}), Error);
  EXPECT_THROW(tiny_config({"spes_config.dashboard_host="}), Error);
  EXPECT_EQ(tiny_config().spes_config.dashboard.port, 0);
  EXPECT_EQ(tiny_config().spes_config.dashboard.host, "127.0.0.1");
}

}  // namespace
