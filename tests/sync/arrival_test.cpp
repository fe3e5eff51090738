// Nodes that arrive mid-run (issue 38 item 6; docs/PROTOCOL.md "Arrivals"): the share rule's
// arrival step on given rates and capacities (round/reassign.h give_to_arrivals), and through
// RoundState directly: ids admitted up to spes_config.max_nodes, a vacant id holding no round
// up (nor the server's end), an arrival taking an expert at the next round boundary (epoch,
// handoff "arrival", rounds.jsonl), an id past max_nodes refused, and a departed id that comes
// back joining as a new node would (it never co-owns an expert: the old owner's upload of it
// is refused once it moved).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "spes/common/strings.h"
#include "spes/io/files.h"
#include "spes/sync/round/reassign.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;
using ::testing::HasSubstr;

namespace {
using Table = std::vector<std::vector<int64_t>>;

// The rounds.jsonl records of the published rounds (also those whose line is not written yet).
std::vector<nlohmann::json> round_lines(const RoundState& st) { return st.round_history(); }
}  // namespace

TEST(ArrivalRule, AnArrivalTakesExpertsFromTheMostLoadedNodesWhichKeepOne) {
  const Table four = {{0, 0, 1, 1, 2, 2, 3, 3}};
  // Equal rates, node 4 arriving: shares 8/5 = 1.6; it takes node 0's highest expert (ties:
  // the lower id), then (0.6 below its share) node 1's; node 0, down to one, gives no more.
  Reassignment r = give_to_arrivals(four, {4}, {{0, 5, 0}, {1, 5, 0}, {2, 5, 0}, {3, 5, 0}, {4, 0, 0}});
  EXPECT_EQ(r.table, (Table{{0, 4, 1, 4, 2, 2, 3, 3}}));
  ASSERT_EQ(r.handoffs.size(), 2u);
  EXPECT_EQ(r.handoffs[0].expert, 1);
  EXPECT_EQ(r.handoffs[0].from, 0);
  EXPECT_EQ(r.handoffs[0].to, 4);
  EXPECT_EQ(r.handoffs[0].why, "arrival");
  EXPECT_EQ(r.handoffs[1].from, 1);
  EXPECT_EQ(r.handoffs[1].expert, 3);
  // Node 2 twice as fast: the arrival's unknown rate counts at the others' median (100), its
  // share 8 x 100 / 600 = 1.33: one expert, from node 0 (node 2 is below its share of 2.67).
  r = give_to_arrivals(four, {4}, {{0, 100, 0}, {1, 100, 0}, {2, 200, 0}, {3, 100, 0}, {4, 0, 0}});
  EXPECT_EQ(r.table, (Table{{0, 4, 1, 1, 2, 2, 3, 3}}));
  // Its declared capacity caps it.
  r = give_to_arrivals(four, {4}, {{0, 5, 0}, {1, 5, 0}, {2, 5, 0}, {3, 5, 0}, {4, 0, 1}});
  EXPECT_EQ(r.table, (Table{{0, 4, 1, 1, 2, 2, 3, 3}}));
  // Two arrivals: one expert each, from the most loaded donors.
  r = give_to_arrivals(four, {4, 5},
                       {{0, 5, 0}, {1, 5, 0}, {2, 5, 0}, {3, 5, 0}, {4, 0, 0}, {5, 0, 0}});
  EXPECT_EQ(r.table, (Table{{0, 4, 1, 5, 2, 2, 3, 3}}));
  // Every node owns one expert: nobody can give one (a donor keeps one); every layer alike.
  r = give_to_arrivals({{0, 1, 2, 3}, {0, 1, 2, 3}}, {4}, {{0, 5, 0}, {1, 5, 0}, {2, 5, 0}, {3, 5, 0}, {4, 0, 0}});
  EXPECT_FALSE(r.changed());
  // Experts of a node that is not live never move.
  r = give_to_arrivals({{0, 0, 0, 1}}, {2}, {{1, 5, 0}, {2, 5, 0}});
  EXPECT_FALSE(r.changed());
}

TEST(Arrivals, AVacantIdHoldsNoRoundUpAndAnArrivalTakesAnExpertAtTheNextBoundary) {
  // max_nodes below num_peers (or absurd) is refused when the config is read.
  EXPECT_THAT(error_of([] { tiny_config({"spes_config.max_nodes=1"}); }),
              HasSubstr("spes_config.max_nodes must be 0 (= num_peers: no arrivals) or in"));
  TempDir dir;
  const Config cfg = arrival_config();
  FakeNode a(cfg, 0, 1), b(cfg, 1, 2), c(cfg, 2, 3);
  ASSERT_EQ(c.reg->trainable_numel() < a.reg->trainable_numel(), true);  // shared tensors only
  RoundState st(cfg, ServeOptions{dir.path});
  // Round 1 publishes with nodes 0 and 1 alone: id 2 never joined and owns nothing.
  arrival_round_1(st, a, b);
  ASSERT_EQ(st.published_round(), 1);
  ServerStatus s = st.status();
  ASSERT_EQ(s.nodes.size(), 3u);
  EXPECT_EQ(s.nodes[2].state, "vacant");
  EXPECT_EQ(st.ownership_at(2).epoch, 0);
  EXPECT_EQ(round_lines(st)[0]["missing"].size(), 0u);
  // An id past max_nodes is refused, naming the setting.
  FakeNode far(cfg, 3, 4);
  EXPECT_EQ(code_of([&] { st.join(far.join_info()); }), SyncErrc::PermissionDenied);
  EXPECT_THAT(error_of([&] { st.join(far.join_info()); }), HasSubstr("max_nodes=3"));
  // Node 2 arrives: round 2 waits for it now, and at its close node 2 takes expert 2.
  JoinInfo j = c.join_info();
  j.expert_capacity = 1;
  EXPECT_EQ(st.join(j).ownership.epoch, 0);
  send_upload(st, a.id, 2, upload_of(a, 2, trained(a, st, 0.002)));
  send_upload(st, b.id, 2, upload_of(b, 2, trained(b, st, 0.002)));
  EXPECT_EQ(st.published_round(), 1);
  EXPECT_EQ(st.status().nodes[2].state, "training");
  send_upload(st, c.id, 2, upload_of(c, 2, trained(c, st, 0.002)));
  ASSERT_EQ(st.published_round(), 2);
  const OwnershipMap m = st.ownership_at(3);
  EXPECT_EQ(m.epoch, 1);
  EXPECT_EQ(m.from_round, 3);
  EXPECT_EQ(m.num_nodes, 3);
  EXPECT_EQ(m.table, (Table{{0, 0, 2, 1}}));
  const nlohmann::json line = round_lines(st)[1];
  EXPECT_EQ(line["ownership_next"]["epoch"], 1);
  ASSERT_EQ(line["handoffs"].size(), 1u);
  EXPECT_EQ(line["handoffs"][0],
            (nlohmann::json{{"layer", 0}, {"expert", 2}, {"from", 0}, {"to", 2},
                            {"why", "arrival"}, {"round", 3}}));
  // Node 0's upload of its epoch-0 set (expert 2 included) is refused; under epoch 1 it is not.
  EXPECT_THAT(error_of([&] {
                send_upload(st, a.id, 3, upload_under(a, st, Ownership(2, {{0, 0, 0, 1}}), 1, 3, 0.1));
              }),
              HasSubstr("expert owned by node 2 in ownership epoch 1"));
  // The run ends when nodes 0-2 have left: no vacant id is waited for.
  for (const FakeNode* n : {&a, &b}) st.leave(n->id, 30, "finished");
  EXPECT_FALSE(st.all_left());
  st.leave(c.id, 30, "finished");
  EXPECT_TRUE(st.all_left());
}

TEST(Arrivals, ADepartedIdThatComesBackJoinsAsANewNodeAndNeverCoOwnsAnExpert) {
  TempDir dir;
  const Config cfg = tiny_config();  // node 0: experts 0-1, node 1: experts 2-3
  RoundState st(cfg, ServeOptions{dir.path});
  FakeNode a(cfg, 0, 1), b(cfg, 1, 2);
  departure_in_round_1(st, a, b);
  ASSERT_EQ(st.published_round(), 1);
  const Ownership all0(2, {{0, 0, 0, 0}});
  ASSERT_EQ(st.ownership_at(2).table, all0.table());
  // Node 1 comes back (a new incarnation, room for one expert): the map gives it nothing, and
  // its upload of its old experts is refused.
  FakeNode b2(cfg, 1, 2);
  b2.id.incarnation = 77;
  JoinInfo j = b2.join_info();
  j.expert_capacity = 1;
  EXPECT_EQ(st.join(j).ownership.table, all0.table());
  EXPECT_THAT(error_of([&] { send_upload(st, b2.id, 2, upload_under(b2, st, Ownership(2, {{0, 0, 1, 1}}), 1, 2, 0.1)); }),
              HasSubstr("expert owned by node 0 in ownership epoch 1"));
  send_upload(st, a.id, 2, upload_under(a, st, all0, 1, 2, 0.002));
  ASSERT_EQ(st.published_round(), 2);
  // At round 2's boundary it takes one expert as an arrival, from node 0, which stops
  // uploading it: one owner per expert.
  const OwnershipMap m = st.ownership_at(3);
  EXPECT_EQ(m.epoch, 2);
  EXPECT_EQ(m.table, (Table{{0, 0, 0, 1}}));
  const nlohmann::json line = round_lines(st)[1];
  ASSERT_EQ(line["handoffs"].size(), 1u);
  EXPECT_EQ(line["handoffs"][0]["from"], 0);
  EXPECT_EQ(line["handoffs"][0]["to"], 1);
  EXPECT_EQ(line["handoffs"][0]["why"], "arrival");
  EXPECT_THAT(error_of([&] { send_upload(st, a.id, 3, upload_under(a, st, all0, 2, 3, 0.1)); }),
              HasSubstr("expert owned by node 1 in ownership epoch 2"));
  EXPECT_EQ(st.status().nodes[1].state, "training");
  EXPECT_TRUE(st.status().departed.empty());
}
