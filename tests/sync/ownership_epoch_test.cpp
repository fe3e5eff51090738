// Ownership epochs on the server (docs/PROTOCOL.md, "Ownership epochs"), driven through
// RoundState directly: the share rule on given rates and capacities (round/reassign.h); a
// departing node's experts handed to a live node at the next round boundary; the new epoch on
// disk before the round that introduces it is published (a save that fails after it leaves a
// restarted server on the old map, consistently); a restarted server continuing with the
// same map; uploads of an expert the node no longer owns refused with the model unchanged; a
// node missing reassign_after_rounds rounds declared departed; joins with an unknown epoch or
// an absurd capacity refused; reassign_after_rounds 0 keeping today's behaviour.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <thread>

#include "spes/common/strings.h"
#include "spes/io/files.h"
#include "spes/model/memory_estimate.h"
#include "spes/sync/round/ownership_map.h"
#include "spes/sync/round/reassign.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

namespace {

Ownership one_layer(int64_t nodes, std::vector<int64_t> row) {
  return Ownership(nodes, {std::move(row)});
}

// Two nodes (node 0: experts 0-1, node 1: experts 2-3), departures after `after` rounds.
Config elastic_config(int64_t after = 3, std::vector<std::string> more = {}) {
  more.push_back("spes_config.reassign_after_rounds=" + std::to_string(after));
  return tiny_config(more);
}

nlohmann::json read_json(const std::string& path) {
  return nlohmann::json::parse(file_read(path));
}

// Three nodes: node 0 owns expert 0, node 1 expert 1, node 2 experts 2 and 3.
Config three_nodes_config() {
  return elastic_config(3, {"spes_config.num_peers=3", "spes_config.expert_owners=[[0,1,2,2]]"});
}

void join_all(RoundState& st, std::initializer_list<const FakeNode*> nodes) {
  for (const FakeNode* n : nodes) st.join(n->join_info());
}

// Node n's upload of `round`: its trainable tensors at the published value + 0.001.
void send_trained(RoundState& st, const FakeNode& n, int64_t round) {
  send_upload(st, n.id, round, upload_of(n, round, trained(n, st, 0.001)));
}
}  // namespace

TEST(ShareRule, ExpertsGoToTheLiveNodeFurthestBelowItsShareOfTheLayer) {
  // 8 experts, node 3 (experts 6, 7) departed; node 2 delivers twice the tokens/s: shares of
  // the 8 experts are 2, 2, 4, so both go to node 2.
  const Ownership cur = one_layer(4, {0, 0, 1, 1, 2, 2, 3, 3});
  const std::map<int64_t, std::string> gone = {{3, "killed"}};
  Reassignment r = reassign_experts(cur, gone, {{0, 100, 0}, {1, 100, 0}, {2, 200, 0}});
  EXPECT_EQ(r.table, (std::vector<std::vector<int64_t>>{{0, 0, 1, 1, 2, 2, 2, 2}}));
  ASSERT_EQ(r.handoffs.size(), 2u);
  EXPECT_EQ(r.handoffs[0].expert, 6);
  EXPECT_EQ(r.handoffs[0].from, 3);
  EXPECT_EQ(r.handoffs[0].to, 2);
  EXPECT_EQ(r.handoffs[0].why, "killed");
  EXPECT_TRUE(r.frozen.empty());
  // Node 2 declares room for 2 experts per layer: it is full, so nodes 0 and 1 (equal
  // shortfall: the lower id first) take one each.
  r = reassign_experts(cur, gone, {{0, 100, 0}, {1, 100, 0}, {2, 200, 2}});
  EXPECT_EQ(r.table, (std::vector<std::vector<int64_t>>{{0, 0, 1, 1, 2, 2, 0, 1}}));
  // Equal rates over 3 live nodes of 4 experts: one each, ties to the lower id.
  r = reassign_experts(one_layer(4, {0, 1, 2, 3}), gone, {{0, 5, 0}, {1, 5, 0}, {2, 5, 0}});
  EXPECT_EQ(r.table, (std::vector<std::vector<int64_t>>{{0, 1, 2, 0}}));
  // A node with no measured rate counts at the median of the others (here 100 = node 0's).
  r = reassign_experts(cur, gone, {{0, 100, 0}, {1, NAN, 0}, {2, 300, 0}});
  EXPECT_EQ(r.table, (std::vector<std::vector<int64_t>>{{0, 0, 1, 1, 2, 2, 2, 2}}));
}

TEST(ShareRule, AnExpertNoLiveNodeCanTakeStaysFrozenWithItsOwner) {
  const Ownership cur = one_layer(3, {0, 1, 2, 2});
  Reassignment r = reassign_experts(cur, {{2, "gone"}}, {{0, 1, 1}, {1, 1, 2}});
  EXPECT_EQ(r.table, (std::vector<std::vector<int64_t>>{{0, 1, 1, 2}}));
  ASSERT_EQ(r.frozen.size(), 1u);
  EXPECT_EQ(r.frozen[0], std::make_pair(int64_t{0}, int64_t{3}));
  r = reassign_experts(cur, {{2, "gone"}}, {});  // nobody live
  EXPECT_FALSE(r.changed());
  EXPECT_EQ(r.frozen.size(), 2u);
  // Every layer on its own: layer 1's shares do not see layer 0's.
  const Ownership two(2, {{0, 0, 1, 1}, {1, 1, 1, 0}});
  r = reassign_experts(two, {{1, "gone"}}, {{0, 1, 3}});
  EXPECT_EQ(r.table, (std::vector<std::vector<int64_t>>{{0, 0, 0, 1}, {0, 0, 1, 0}}));
  EXPECT_EQ(r.frozen.size(), 2u);
}

// Issue 38 item 5: the experts per layer a node's declared memory holds cap it like a declared
// capacity; the smaller of the two counts (max_experts).
TEST(ShareRule, ADeclaredMemoryCapsANodeAndTheSmallerCapCounts) {
  const Ownership cur = one_layer(4, {0, 0, 1, 1, 2, 2, 3, 3});
  const std::map<int64_t, std::string> gone = {{3, "killed"}};
  // Node 2's memory holds the 2 experts it owns: it is full, as with capacity 2.
  const std::vector<std::vector<int64_t>> full = {{0, 0, 1, 1, 2, 2, 0, 1}};
  EXPECT_EQ(reassign_experts(cur, gone, {{0, 100, 0}, {1, 100, 0}, {2, 200, 0, 2}}).table, full);
  EXPECT_EQ(reassign_experts(cur, gone, {{0, 100, 0}, {1, 100, 0}, {2, 200, 8, 2}}).table, full);
  EXPECT_EQ(reassign_experts(cur, gone, {{0, 100, 0}, {1, 100, 0}, {2, 200, 2, 8}}).table, full);
  // Room for 3: it takes one, as its rate would give it both.
  EXPECT_EQ(reassign_experts(cur, gone, {{0, 100, 0}, {1, 100, 0}, {2, 200, 0, 3}}).table,
            (std::vector<std::vector<int64_t>>{{0, 0, 1, 1, 2, 2, 2, 0}}));
  // Memory for no expert at all (0): nothing more, not "no cap".
  const Reassignment r =
      reassign_experts(one_layer(2, {0, 1, 1, 1}), {{1, "gone"}}, {{0, 1, 0, 0}});
  EXPECT_EQ(r.frozen.size(), 3u);
  EXPECT_EQ((LiveNode{0, 1, 0, -1}).max_experts(), -1);
  EXPECT_EQ((LiveNode{0, 1, 3, -1}).max_experts(), 3);
  EXPECT_EQ((LiveNode{0, 1, 0, 0}).max_experts(), 0);
  EXPECT_EQ((LiveNode{0, 1, 3, 5}).max_experts(), 3);
}

TEST(OwnershipEpochs, AMapIsCheckedAgainstItsFingerprint) {
  const OwnershipMap m = ownership_map(one_layer(2, {0, 0, 1, 1}), 3, 7);
  EXPECT_EQ(ownership_of(m, 2, 1, 4, "test").fingerprint(), m.fingerprint);
  OwnershipMap bad = m;
  bad.table[0][3] = 0;
  EXPECT_THAT(error_of([&] { ownership_of(bad, 2, 1, 4, "test"); }), HasSubstr("hashes to"));
  bad = m;
  bad.table[0][3] = 5;
  EXPECT_THAT(error_of([&] { ownership_of(bad, 2, 1, 4, "test"); }), HasSubstr("outside"));
  EXPECT_THAT(error_of([&] { ownership_of(m, 2, 2, 4, "test"); }), HasSubstr("layers"));
  EXPECT_EQ(ownership_map_from_json(ownership_map_json(m)).table, m.table);
}

TEST(OwnershipEpochs, AnEpochIsOnDiskBeforeItsRoundIsPublished) {
  TempDir dir;
  const Config cfg = elastic_config();
  const std::string file = dir.path + "/ownership.json";
  {
    RoundState st(cfg, ServeOptions{dir.path});
    FakeNode a(cfg, 0, 1), b(cfg, 1, 2);
    st.join(a.join_info());
    st.join(b.join_info());
    send_trained(st, a, 1);
    ASSERT_EQ(read_json(file)["epochs"].size(), 1u);
    // ownership.json fits, the published model does not: the round closes, its new epoch is
    // saved, the model's save fails, so the round is not published.
    const uint64_t limit = fs::file_size(file) * 6;
    ASSERT_LT(limit, fs::file_size(dir.path + "/published.safetensors"));
    FileSizeLimit full(limit);
    st.leave(b.id, 10, "for good", LeaveKind::Departing);
    EXPECT_EQ(st.published_round(), 0);
    EXPECT_THAT(st.status().publish_error, HasSubstr("disk full"));
    const nlohmann::json saved = read_json(file);
    ASSERT_EQ(saved["epochs"].size(), 2u);
    EXPECT_EQ(saved["epochs"][1]["map"]["epoch"], 1);
    EXPECT_EQ(saved["epochs"][1]["map"]["from_round"], 2);
    EXPECT_EQ(saved["epochs"][1]["map"]["table"].get<std::vector<std::vector<int64_t>>>(),
              (std::vector<std::vector<int64_t>>{{0, 0, 0, 0}}));
    EXPECT_EQ(saved["epochs"][1]["handoffs"].size(), 2u);
    // Nothing published uses it yet.
    EXPECT_EQ(st.ownership_at(1).epoch, 0);
    EXPECT_EQ(st.model().plan().ownership_epoch(), 0);
  }
  // Killed before the round was published: a restarted server is at round 0 with epoch 0 and
  // drops the unpublished epoch from the file.
  RoundState again(cfg, ServeOptions{dir.path});
  EXPECT_EQ(again.published_round(), 0);
  EXPECT_EQ(again.ownership_at(2).epoch, 0);
  EXPECT_EQ(again.model().plan().ownership_epoch(), 0);
  EXPECT_EQ(read_json(file)["epochs"].size(), 1u);
}

TEST(OwnershipEpochs, ADepartingNodesExpertsGoToALiveNodeAndARestartKeepsTheMap) {
  TempDir dir;
  const Config cfg = elastic_config();
  const Ownership next = one_layer(2, {0, 0, 0, 0});
  std::string sha1;
  {
    RoundState st(cfg, ServeOptions{dir.path});
    FakeNode a(cfg, 0, 1), b(cfg, 1, 2);
    departure_in_round_1(st, a, b);
    ASSERT_EQ(st.published_round(), 1);
    // Round 1 was collected under epoch 0; round 2 is under epoch 1, node 0 owning all four.
    EXPECT_EQ(st.ownership_at(1).epoch, 0);
    const OwnershipMap m = st.ownership_at(2);
    EXPECT_EQ(m.epoch, 1);
    EXPECT_EQ(m.from_round, 2);
    EXPECT_EQ(m.fingerprint, next.fingerprint());
    EXPECT_EQ(st.model().plan().ownership_epoch(), 1);
    EXPECT_EQ(st.model().published_plan().ownership_epoch(), 0);
    const ServerStatus s = st.status();
    EXPECT_EQ(s.ownership_epoch, 1);
    EXPECT_EQ(s.departed, std::vector<int64_t>{1});
    EXPECT_TRUE(s.frozen_experts.empty());
    EXPECT_EQ(s.nodes[1].state, "departed");
    // A join (a restarted node holding epoch 0) gets the current map.
    FakeNode b2(cfg, 1, 3);
    b2.id.incarnation = 77;
    const JoinResult jr = st.join(b2.join_info());
    EXPECT_EQ(jr.ownership.epoch, 1);
    EXPECT_EQ(jr.ownership.table, next.table());
    // Its upload of the experts it no longer owns is refused, naming the owner and epoch.
    const std::string stale = error_of([&] { send_upload(st, b2.id, 2, upload_of(b2, 2, trained(b2, st, 0.5))); });
    EXPECT_THAT(stale, HasSubstr("expert owned by node 0 in ownership epoch 1"));
    // It stops (had it stayed, it would take an expert at the next boundary as an arrival:
    // arrival_test.cpp).
    st.leave(b2.id, 20, "finished");
    // Node 0 under the new map: its upload of all four experts is the published value.
    const auto up = upload_under(a, st, next, 1, 2, 0.003);
    const NamedTensors sent = [&] {
      NamedTensors t;
      const ParamRegistry reg(*a.model, cfg, next, 0);
      for (const auto& e : reg.entries())
        if (e.trainable)
          t.emplace_back(e.name,
                         st.model().tensors().at(st.model().plan().index(e.name)).clone() + 0.003);
      return t;
    }();
    send_upload(st, a.id, 2, up);
    ASSERT_EQ(st.published_round(), 2);
    int experts = 0;
    for (const auto& [name, value] : sent) {
      const PlanTensor& t = st.model().plan().tensors()[st.model().plan().index(name)];
      if (t.role != ParamRole::Expert) continue;
      ++experts;
      EXPECT_TRUE(torch::equal(st.model().tensors()[st.model().plan().index(name)], value))
          << name;
    }
    EXPECT_EQ(experts, 4 * 3);  // gate, up, down of 4 experts
    sha1 = st.status().model_sha256;
  }
  // rounds.jsonl: round 1 introduced epoch 1 with two handoffs from node 1 to node 0.
  std::vector<nlohmann::json> lines;
  for (const std::string& l : split(file_read(dir.path + "/rounds.jsonl"), '\n'))
    if (!l.empty()) lines.push_back(nlohmann::json::parse(l));
  ASSERT_GE(lines.size(), 2u);
  EXPECT_EQ(lines[0]["ownership_epoch"], 0);
  EXPECT_EQ(lines[0]["ownership_next"]["epoch"], 1);
  ASSERT_EQ(lines[0]["handoffs"].size(), 2u);
  EXPECT_EQ(lines[0]["handoffs"][0]["from"], 1);
  EXPECT_EQ(lines[0]["handoffs"][0]["to"], 0);
  EXPECT_THAT(lines[0]["handoffs"][0]["why"].get<std::string>(), HasSubstr("departing"));
  EXPECT_EQ(lines[1]["ownership_epoch"], 1);
  EXPECT_FALSE(lines[1].contains("handoffs"));
  // A restarted server continues with the same map and model.
  RoundState again(cfg, ServeOptions{dir.path});
  EXPECT_EQ(again.published_round(), 2);
  EXPECT_EQ(again.status().model_sha256, sha1);
  EXPECT_EQ(again.ownership_at(3).fingerprint, next.fingerprint());
  EXPECT_EQ(again.model().plan().ownership_epoch(), 1);
  EXPECT_EQ(again.model().plan().ownership().table(), next.table());
  // An offline replay (spes aggregate --ownership) finds each round's map in ownership.json;
  // a damaged map is refused, naming the file.
  const std::string path = dir.path + "/ownership.json";
  nlohmann::json doc = read_json(path);
  EXPECT_EQ(ownership_map_at_round(doc, 1, 1, 4, path).epoch, 0);
  EXPECT_EQ(ownership_map_at_round(doc, 2, 1, 4, path).fingerprint, next.fingerprint());
  EXPECT_EQ(ownership_map_at_round(doc, 9, 1, 4, path).epoch, 1);
  doc["epochs"][1]["map"]["table"][0][3] = 1;
  EXPECT_THAT(error_of([&] { ownership_map_at_round(doc, 2, 1, 4, path); }),
              HasSubstr("hashes to"));
  EXPECT_THAT(error_of([&] { ownership_map_at_round(nlohmann::json::object(), 2, 1, 4, path); }),
              HasSubstr("not an ownership file"));
}

TEST(OwnershipEpochs, AnUploadUnderAnOlderEpochIsRefusedAndTheModelUnchanged) {
  TempDir dir;
  const Config cfg = three_nodes_config();
  RoundState st(cfg, ServeOptions{dir.path});
  FakeNode a(cfg, 0, 1), b(cfg, 1, 2), c(cfg, 2, 3);
  join_all(st, {&a, &b, &c});
  send_trained(st, a, 1);
  send_trained(st, b, 1);
  st.leave(c.id, 10, "for good", LeaveKind::Departing);
  ASSERT_EQ(st.published_round(), 1);
  const OwnershipMap m = st.ownership_at(2);
  ASSERT_EQ(m.epoch, 1);
  // Node 2's experts 2 and 3 went one to each live node (which first follows their rates).
  ASSERT_EQ(m.table.size(), 1u);
  EXPECT_EQ(m.table[0][0], 0);
  EXPECT_EQ(m.table[0][1], 1);
  EXPECT_NE(m.table[0][2], m.table[0][3]);
  EXPECT_NE(m.table[0][2], 2);
  EXPECT_NE(m.table[0][3], 2);
  const std::string before = st.status().model_sha256;
  // Node 1 uploads under the new map but says epoch 0: refused before any tensor.
  const Ownership next(3, m.table);
  EXPECT_THAT(error_of([&] { send_upload(st, b.id, 2, upload_under(b, st, next, 0, 2, 0.2)); }),
              HasSubstr("trained under ownership epoch 0 but round 2 uses epoch 1"));
  // Node 0 uploads its old set (epoch 0's): refused, it lacks expert 2 it now owns.
  EXPECT_EQ(code_of([&] {
              send_upload(st, a.id, 2, upload_under(a, st, one_layer(3, {0, 1, 2, 2}), 1, 2, 0.2));
            }),
            SyncErrc::InvalidArgument);
  EXPECT_EQ(st.status().model_sha256, before);
}

// A node that uploads its round and then departs for good (Ctrl-C while it waits for the
// round): the round uses its upload (its experts' last training) and still introduces the next
// epoch without it; a restarted server keeps it departed. (Found by the end-to-end crash test
// under load: the used upload made the node live again, and its experts moved only
// reassign_after_rounds rounds later.)
TEST(OwnershipEpochs, ANodeThatDepartsAfterItsUploadStaysDepartedWhenTheRoundUsesIt) {
  TempDir dir;
  const Config cfg = three_nodes_config();
  {
    RoundState st(cfg, ServeOptions{dir.path});
    FakeNode a(cfg, 0, 1), b(cfg, 1, 2), c(cfg, 2, 3);
    join_all(st, {&a, &b, &c});
    send_trained(st, a, 1);
    send_trained(st, c, 1);
    st.leave(c.id, 10, "for good", LeaveKind::Departing);
    ASSERT_EQ(st.published_round(), 0);  // node 1's upload is still to come
    send_trained(st, b, 1);
    ASSERT_EQ(st.published_round(), 1);
    EXPECT_EQ(st.status().departed, std::vector<int64_t>{2});
    const OwnershipMap m = st.ownership_at(2);
    EXPECT_EQ(m.epoch, 1);
    EXPECT_EQ(m.from_round, 2);
    for (int64_t owner : m.table.at(0)) EXPECT_NE(owner, 2) << nlohmann::json(m.table).dump();
  }
  const nlohmann::json line = nlohmann::json::parse(split(file_read(dir.path + "/rounds.jsonl"), '\n')[0]);
  EXPECT_EQ(line["nodes"], (std::vector<int64_t>{0, 1, 2}));
  ASSERT_EQ(line["handoffs"].size(), 2u) << line.dump();
  EXPECT_THAT(line["handoffs"][0]["why"].get<std::string>(), HasSubstr("departing"));
  RoundState again(cfg, ServeOptions{dir.path});
  EXPECT_EQ(again.status().departed, std::vector<int64_t>{2});
  EXPECT_EQ(again.model().plan().ownership_epoch(), 1);
}

// A node declared departed for its misses whose upload a later round uses is live again (it
// trains what the current map gives it: here nothing but the shared tensors).
TEST(OwnershipEpochs, ANodeDeclaredDepartedForItsMissesIsLiveAgainWhenARoundUsesItsUpload) {
  TempDir dir;
  const Config cfg = elastic_config(1, {"spes_config.round_timeout=0.05", "spes_config.min_nodes=1"});
  RoundState st(cfg, ServeOptions{dir.path});
  FakeNode a(cfg, 0, 1), b(cfg, 1, 2);
  st.join(a.join_info());
  st.join(b.join_info());  // joined and alive, but misses round 1
  send_trained(st, a, 1);
  while (st.published_round() < 1) {  // publishes at its deadline with node 0 alone
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    st.tick();
  }
  ASSERT_EQ(st.status().departed, std::vector<int64_t>{1});
  const OwnershipMap m = st.ownership_at(2);
  ASSERT_EQ(m.epoch, 1);
  const Ownership next(2, m.table);
  // Node 1's upload first: a round does not wait for a departed node.
  send_upload(st, b.id, 2, upload_under(b, st, next, 1, 2, 0.001));
  send_upload(st, a.id, 2, upload_under(a, st, next, 1, 2, 0.001));
  ASSERT_EQ(st.published_round(), 2);
  EXPECT_TRUE(st.status().departed.empty());
  EXPECT_NE(st.status().nodes[1].state, "departed");
}

TEST(OwnershipEpochs, ANodeMissingReassignAfterRoundsRoundsIsDeclaredDeparted) {
  TempDir dir;
  const Config cfg = elastic_config(2, {"spes_config.round_timeout=0.05", "spes_config.min_nodes=1"});
  RoundState st(cfg, ServeOptions{dir.path});
  FakeNode a(cfg, 0, 1), b(cfg, 1, 2);
  st.join(a.join_info());
  st.join(b.join_info());  // joined and alive, but never uploads
  for (int64_t round = 1; round <= 2; ++round) {
    send_upload(st, a.id, round, upload_of(a, round, trained(a, st, 0.001)));
    while (st.published_round() < round) {  // publishes at its deadline with node 0 alone
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      st.tick();
    }
    EXPECT_EQ(st.ownership_at(round + 1).epoch, round == 1 ? 0 : 1) << round;
  }
  EXPECT_EQ(st.status().departed, std::vector<int64_t>{1});
  EXPECT_EQ(st.ownership_at(3).table, (std::vector<std::vector<int64_t>>{{0, 0, 0, 0}}));
}

// In fedavg and diloco there is no ownership to move: a node that misses rounds is not
// declared departed (rounds then stop waiting for an alive node and take whichever uploads
// came first; in the outer-step grid such runs stopped being reproducible).
TEST(OwnershipEpochs, MissedRoundsDeclareNobodyDepartedOutsideModeSpes) {
  TempDir dir;
  const Config cfg = elastic_config(1, {"spes_config.mode=fedavg", "spes_config.round_timeout=0.05",
                                        "spes_config.min_nodes=1"});
  RoundState st(cfg, ServeOptions{dir.path});
  FakeNode a(cfg, 0, 1), b(cfg, 1, 2);
  join_all(st, {&a, &b});  // node 1 joined and alive, but never uploads
  for (int64_t round = 1; round <= 2; ++round) {
    send_trained(st, a, round);
    while (st.published_round() < round) {  // publishes at its deadline with node 0 alone
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      st.tick();
    }
  }
  EXPECT_TRUE(st.status().departed.empty());
  EXPECT_NE(st.status().nodes[1].state, "departed");
}

TEST(OwnershipEpochs, ZeroKeepsTheConfigsMapForTheWholeRun) {
  TempDir dir;
  const Config cfg = elastic_config(0);
  RoundState st(cfg, ServeOptions{dir.path});
  FakeNode a(cfg, 0, 1), b(cfg, 1, 2);
  departure_in_round_1(st, a, b);
  ASSERT_EQ(st.published_round(), 1);
  EXPECT_EQ(st.ownership_at(2).epoch, 0);
  EXPECT_EQ(st.model().plan().ownership_epoch(), 0);
}

TEST(OwnershipEpochs, JoinsWithAnUnknownEpochOrAnAbsurdCapacityAreRefused) {
  TempDir dir;
  const Config cfg = elastic_config();
  RoundState st(cfg, ServeOptions{dir.path});
  FakeNode a(cfg, 0, 1);
  JoinInfo j = a.join_info();
  j.ownership_epoch = 4;
  EXPECT_EQ(code_of([&] { st.join(j); }), SyncErrc::FailedPrecondition);
  EXPECT_THAT(error_of([&] { st.join(j); }), HasSubstr("holds ownership epoch 4"));
  j = a.join_info();
  j.ownership_fingerprint = "0123456789abcdef";  // epoch 0 but not the config's map
  EXPECT_THAT(error_of([&] { st.join(j); }), HasSubstr("ownership history"));
  j = a.join_info();
  j.expert_capacity = 1000;
  EXPECT_EQ(code_of([&] { st.join(j); }), SyncErrc::InvalidArgument);
  EXPECT_THAT(error_of([&] { st.join(j); }), HasSubstr("expert_capacity 1000"));
  j.expert_capacity = 2;
  EXPECT_EQ(st.join(j).ownership.epoch, 0);
}

// Issue 38 item 5: a node declares the memory it can train in; the server turns it into
// experts per layer with the closed-form estimate (model/memory_estimate.h). Node 0 declares
// exactly what training its 2 experts per layer needs: when node 1 departs, node 0 can take
// none of its experts (they stay frozen, the map stays epoch 0); declaring room for 3 on a
// new join, it takes one at the next boundary and the other stays frozen.
TEST(OwnershipEpochs, ANodeTakesNoMoreExpertsThanItsDeclaredMemoryHolds) {
  TempDir dir;
  const Config cfg = elastic_config();
  RoundState st(cfg, ServeOptions{dir.path});
  FakeNode a(cfg, 0, 1), b(cfg, 1, 2);
  auto declaring = [&](int64_t experts) {
    JoinInfo j = a.join_info();
    j.memory_capacity_gib =
        static_cast<double>(node_memory_training(cfg, experts, Precision::Fp32).total()) /
        1073741824.0;
    j.precision = "fp32";
    return j;
  };
  st.join(declaring(2));
  st.join(b.join_info());
  send_trained(st, a, 1);
  st.leave(b.id, 10, "for good", LeaveKind::Departing);
  ASSERT_EQ(st.published_round(), 1);
  EXPECT_EQ(st.ownership_at(2).epoch, 0);
  EXPECT_EQ(st.status().frozen_experts.size(), 2u);
  st.join(declaring(3));
  send_trained(st, a, 2);
  ASSERT_EQ(st.published_round(), 2);
  const OwnershipMap m = st.ownership_at(3);
  EXPECT_EQ(m.epoch, 1);
  EXPECT_EQ(m.table, (std::vector<std::vector<int64_t>>{{0, 0, 0, 1}}));
  EXPECT_EQ(st.status().frozen_experts.size(), 1u);
}

// A declaration the server cannot believe is refused at Join with the reason, and the node is
// not joined: not a number, negative, infinite, above spes_config.max_memory_capacity_gib, or
// an unknown precision. 0 (not declared) and a plausible figure are accepted.
TEST(OwnershipEpochs, AMemoryDeclarationTheServerCannotBelieveIsRefusedAtJoin) {
  TempDir dir;
  const Config cfg = elastic_config(3, {"spes_config.max_memory_capacity_gib=1024"});
  RoundState st(cfg, ServeOptions{dir.path});
  FakeNode a(cfg, 0, 1);
  auto refusal = [&](double gib, const std::string& precision) {
    JoinInfo j = a.join_info();
    j.memory_capacity_gib = gib;
    j.precision = precision;
    EXPECT_EQ(code_of([&] { st.join(j); }), SyncErrc::InvalidArgument) << gib << precision;
    return error_of([&] { st.join(j); });
  };
  EXPECT_THAT(refusal(std::nan(""), ""), HasSubstr("not a number >= 0"));
  EXPECT_THAT(refusal(-1, ""), HasSubstr("not a number >= 0"));
  EXPECT_THAT(refusal(std::numeric_limits<double>::infinity(), ""), HasSubstr("not a number"));
  EXPECT_THAT(refusal(4096, ""), HasSubstr("max_memory_capacity_gib 1024"));
  EXPECT_THAT(refusal(8, "fp64"), HasSubstr("precision 'fp64'"));
  EXPECT_EQ(st.status().nodes[0].state, "not_joined");
  JoinInfo j = a.join_info();
  j.memory_capacity_gib = 8;
  j.precision = "amp_bf16";
  EXPECT_EQ(st.join(j).ownership.epoch, 0);
  EXPECT_EQ(st.status().nodes[0].state, "training");
}
