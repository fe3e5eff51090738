// The AdamW moments a departing node hands over (protocol 9; round/moments_handoff.h,
// server/handed_moments.h): the server's checks of a handover (shapes, dtypes, finite values,
// experts the sender owns under the collecting round's epoch, whole experts, metadata), each
// refusal naming the problem and keeping nothing; an accepted handover kept on disk, handed to
// the expert's next owner exactly, kept by a restarted server, and removed when the run ends;
// the moments of experts a live node lost to an arrival (protocol 10).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "spes/io/files.h"
#include "spes/model/transformer.h"
#include "spes/sync/round/moments_handoff.h"
#include "spes/sync/wire/checksum.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

namespace {

Config handoff_config() { return tiny_config({"spes_config.reassign_after_rounds=3"}); }

// Moments of the given experts ([layer, expert]) as a node would hand them over: random
// exp_avg, positive exp_avg_sq, step 7, no re-warm-up.
ExpertMoments moments_of(const Transformer& model,
                         const std::vector<std::pair<int64_t, int64_t>>& experts, uint64_t seed) {
  torch::manual_seed(seed);
  ExpertMoments m;
  for (const auto& [l, e] : experts)
    for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
      const std::string name = expert_param_name(l, e, proj);
      torch::Tensor like;
      for (const auto& p : model.params())
        if (p.name == name) like = p.tensor;
      m.by_name[name] = {torch::randn(like.sizes()), torch::rand(like.sizes()) + 0.01, 7, -1};
    }
  return m;
}

Metadata meta_of(int64_t node, int64_t epoch, bool lost = false) {
  return moments_metadata({node, epoch, 40, lost});
}

// check_moments_handoff's refusal of `ts` from node 1 under `plan`.
std::string refusal(const RoundPlan& plan, const NamedTensors& ts, const Metadata& md) {
  return error_of([&] { check_moments_handoff(plan, ts, md, 1, "moments of node 1"); });
}

NamedTensors with(NamedTensors ts, const std::string& name, const torch::Tensor& t) {
  for (auto& [k, v] : ts)
    if (k == name) v = t;
  return ts;
}

// Streams a handover into `st` in chunks of 100 bytes; returns {experts, epoch}.
std::pair<int64_t, int64_t> hand_over(RoundState& st, const NodeId& id, const ExpertMoments& m,
                                      int64_t epoch, bool lost = false) {
  const std::string bytes =
      safetensors_serialize(moments_tensors(m), meta_of(id.node_id, epoch, lost));
  auto in = st.begin_hand_over(id, bytes.size());
  for (size_t off = 0; off < bytes.size(); off += 100) {
    const std::string piece = bytes.substr(off, 100);
    in->chunk(off, piece, chunk_checksum(piece));
  }
  in->finish(chunk_checksum(bytes));
  return st.finish_hand_over(id, *in);
}

}  // namespace

TEST(MomentsHandoff, TheServerRefusesHandoversThatAreNotTheSendersWholeFiniteExperts) {
  const Config cfg = handoff_config();  // node 0: experts 0-1, node 1: experts 2-3
  Transformer model(cfg.model);
  model.init_weights(1);
  const RoundPlan plan(cfg, model);
  const NamedTensors good = moments_tensors(moments_of(model, {{0, 2}, {0, 3}}, 5));
  const auto experts = check_moments_handoff(plan, good, meta_of(1, 0), 1, "moments of node 1");
  EXPECT_EQ(experts, (std::vector<std::pair<int64_t, int64_t>>{{0, 2}, {0, 3}}));

  const std::string gate = expert_param_name(0, 2, "gate_proj");
  EXPECT_THAT(refusal(plan, with(good, "exp_avg/" + gate, torch::zeros({3, 3})), meta_of(1, 0)),
              HasSubstr("has shape [3, 3] but the model's tensor has"));
  const torch::Tensor m = [&] {
    for (const auto& [k, v] : good)
      if (k == "exp_avg/" + gate) return v;
    return torch::Tensor();
  }();
  EXPECT_THAT(refusal(plan, with(good, "exp_avg/" + gate, m.to(torch::kFloat64)), meta_of(1, 0)),
              HasSubstr("must be F32"));
  torch::Tensor nan = m.clone();
  nan.view(-1)[3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(refusal(plan, with(good, "exp_avg/" + gate, nan), meta_of(1, 0)),
              HasSubstr("'exp_avg/" + gate + "' holds NaN or Inf"));
  torch::Tensor inf = m.clone().abs();
  inf.view(-1)[0] = std::numeric_limits<float>::infinity();
  EXPECT_THAT(refusal(plan, with(good, "exp_avg_sq/" + gate, inf), meta_of(1, 0)),
              HasSubstr("holds NaN or Inf"));
  EXPECT_THAT(refusal(plan, with(good, "exp_avg_sq/" + gate, -m.abs() - 1), meta_of(1, 0)),
              HasSubstr("negative values"));
  EXPECT_THAT(refusal(plan, with(good, "step/" + gate, torch::tensor(int64_t{-2})), meta_of(1, 0)),
              HasSubstr("negative"));
  // An expert the sender never owned: node 0's expert 0.
  const NamedTensors theirs = moments_tensors(moments_of(model, {{0, 0}}, 6));
  EXPECT_THAT(refusal(plan, theirs, meta_of(1, 0)),
              HasSubstr("expert 0 of layer 0 ('" + expert_param_name(0, 0, "down_proj") +
                        "') is owned by node 0 in ownership epoch 0, not by node 1"));
  // The wrong epoch: the sender says epoch 1, the round being collected is under epoch 0.
  EXPECT_THAT(refusal(plan, good, meta_of(1, 1)),
              HasSubstr("owned under ownership epoch 1 but the round being collected uses "
                        "epoch 0"));
  // Another node's name in the metadata, another format.
  EXPECT_THAT(refusal(plan, good, meta_of(0, 0)), HasSubstr("say node 0 but come from node 1"));
  Metadata other = meta_of(1, 0);
  other["format"] = "spes-upload-v1";
  EXPECT_THAT(refusal(plan, good, other), HasSubstr("format must be 'spes-moments-v1'"));
  // Part of an expert, part of a tensor's entries, a shared tensor, a stray name.
  NamedTensors part;
  for (const auto& [k, v] : good)
    if (k.find("up_proj") == std::string::npos) part.emplace_back(k, v);
  EXPECT_THAT(refusal(plan, part, meta_of(1, 0)), HasSubstr("come whole"));
  NamedTensors no_step;
  for (const auto& [k, v] : good)
    if (k != "step/" + gate) no_step.emplace_back(k, v);
  EXPECT_THAT(refusal(plan, no_step, meta_of(1, 0)), HasSubstr("'step/" + gate + "' is missing"));
  NamedTensors shared = good;
  const std::string emb = plan.tensors()[0].name;
  const torch::Tensor e = torch::zeros(plan.tensors()[0].shape);
  for (const char* p : {"exp_avg/", "exp_avg_sq/"}) shared.emplace_back(p + emb, e);
  shared.emplace_back("step/" + emb, torch::tensor(int64_t{1}));
  shared.emplace_back("rewarm_from/" + emb, torch::tensor(int64_t{-1}));
  EXPECT_THAT(refusal(plan, shared, meta_of(1, 0)), HasSubstr("is a shared tensor"));
  NamedTensors stray = good;
  stray.emplace_back("weights/" + gate, m);
  EXPECT_THAT(refusal(plan, stray, meta_of(1, 0)), HasSubstr("is not a moments entry"));
  EXPECT_THAT(refusal(plan, {}, meta_of(1, 0)), HasSubstr("no moments"));
}

TEST(MomentsHandoff, KeptOnDiskHandedToTheNextOwnerExactlyAndRemovedWhenTheRunEnds) {
  TempDir dir;
  const Config cfg = handoff_config();
  FakeNode a(cfg, 0, 1), b(cfg, 1, 2);
  const ExpertMoments mb = moments_of(*b.model, {{0, 2}, {0, 3}}, 9);
  {
    RoundState st(cfg, ServeOptions{dir.path});
    st.join(a.join_info());
    st.join(b.join_info());
    // Node 1 claiming node 0's experts, or under an epoch the server is not at: refused, and
    // nothing is kept.
    EXPECT_THAT(error_of([&] { hand_over(st, b.id, moments_of(*b.model, {{0, 1}}, 3), 0); }),
                HasSubstr("is owned by node 0 in ownership epoch 0, not by node 1"));
    EXPECT_THAT(error_of([&] { hand_over(st, b.id, mb, 2); }), HasSubstr("epoch 2"));
    // A stream larger than node 1's experts can need, or with a damaged chunk.
    EXPECT_THAT(error_of([&] { st.begin_hand_over(b.id, uint64_t{1} << 30); }),
                HasSubstr("the experts it owns need at most"));
    {
      auto in = st.begin_hand_over(b.id, 10);
      EXPECT_THAT(error_of([&] { in->chunk(0, "0123456789", chunk_checksum("0123456780")); }),
                  HasSubstr("does not match its checksum"));
    }
    EXPECT_FALSE(fs::exists(dir.path + "/handoff/moments-node1-epoch0.safetensors"));
    for (const auto& f : fs::directory_iterator(dir.path + "/handoff"))
      ADD_FAILURE() << "left behind: " << f.path();
    // Node 1's own experts: kept, then it departs; the next round hands them to node 0.
    EXPECT_EQ(hand_over(st, b.id, mb, 0), (std::pair<int64_t, int64_t>{2, 0}));
    EXPECT_TRUE(fs::exists(dir.path + "/handoff/moments-node1-epoch0.safetensors"));
    send_upload(st, a.id, 1, upload_of(a, 1, trained(a, st, 0.001)));
    st.leave(b.id, 40, "for good", LeaveKind::Departing);
    ASSERT_EQ(st.ownership_at(2).epoch, 1);
    // Node 1 owns nothing under epoch 1: a second handover is refused, whether it says epoch 1
    // or the epoch 0 it last applied.
    EXPECT_THAT(error_of([&] { hand_over(st, b.id, mb, 1); }), HasSubstr("not by node 1"));
    EXPECT_THAT(error_of([&] { hand_over(st, b.id, mb, 0); }), HasSubstr("not by node 1"));
    // Node 0 has not applied epoch 1 yet: its moments of experts 0 and 1, still its own, under
    // the epoch 0 it trains under are kept (as of epoch 1).
    EXPECT_EQ(hand_over(st, a.id, moments_of(*a.model, {{0, 0}, {0, 1}}, 4), 0),
              (std::pair<int64_t, int64_t>{2, 1}));
    EXPECT_TRUE(fs::exists(dir.path + "/handoff/moments-node0-epoch1.safetensors"));
  }
  // A restarted server still has them, and gives node 0 exactly what node 1 sent.
  RoundState st(cfg, ServeOptions{dir.path});
  st.join(a.join_info());
  const ExpertMoments got = moments_from_tensors(st.handed_moments(a.id, 1), "fetched");
  ASSERT_EQ(got.by_name.size(), mb.by_name.size());
  for (const auto& [name, e] : mb.by_name) {
    const auto& g = got.by_name.at(name);
    EXPECT_TRUE(torch::equal(g.exp_avg, e.exp_avg)) << name;
    EXPECT_TRUE(torch::equal(g.exp_avg_sq, e.exp_avg_sq)) << name;
    EXPECT_EQ(g.step, 7);
    EXPECT_EQ(g.rewarm_from, -1);
  }
  EXPECT_EQ(moments_sha256(got), moments_sha256(mb));
  EXPECT_THAT(error_of([&] { st.handed_moments(a.id, 5); }), HasSubstr("epochs with handoffs "
                                                                         "are 1..1"));
  // The run ends (every node left or departed): the files go.
  st.leave(a.id, 100, "finished");
  ASSERT_TRUE(st.all_left());
  st.close();
  EXPECT_FALSE(fs::exists(dir.path + "/handoff"));
}

// Protocol 10: node 2 arrives and takes expert 2 from node 0 (sync_test_util.h
// arrival_round_2); node 0, live, hands over that expert's moments as "lost" right after
// applying epoch 1. Refused, nothing kept: an expert it never owned, one it still owns, another
// epoch than the one before the collecting round's, the arrival handing over what it gained, a
// "lost" handover at epoch 0. The arrival's fetch, started before node 0 handed them over,
// waits for them and gets them exactly.
TEST(MomentsHandoff, ExpertsLostToAnArrivalComeFromTheirLiveOwnerAndNothingElseIsKept) {
  TempDir dir;
  const Config cfg = arrival_config();
  FakeNode a(cfg, 0, 1), b(cfg, 1, 2), c(cfg, 2, 3);
  RoundState st(cfg, ServeOptions{dir.path});
  arrival_round_1(st, a, b);
  EXPECT_THAT(error_of([&] { hand_over(st, a.id, moments_of(*a.model, {{0, 2}}, 1), 0, true); }),
              HasSubstr("the run's first"));
  arrival_round_2(st, a, b, c);
  ASSERT_EQ(st.ownership_at(3).table, (std::vector<std::vector<int64_t>>{{0, 0, 2, 1}}));
  const ExpertMoments lost = moments_of(*a.model, {{0, 2}}, 5);
  NamedTensors fetched;
  std::thread fetch([&] { fetched = st.handed_moments(c.id, 1); });
  EXPECT_THAT(error_of([&] { hand_over(st, a.id, moments_of(*a.model, {{0, 3}}, 6), 0, true); }),
              HasSubstr("was owned by node 1 in ownership epoch 0, not by node 0"));
  EXPECT_THAT(error_of([&] { hand_over(st, a.id, moments_of(*a.model, {{0, 1}, {0, 2}}, 6), 0, true); }),
              HasSubstr("node 0 still owns expert 1 of layer 0"));
  EXPECT_THAT(error_of([&] { hand_over(st, a.id, lost, 1, true); }),
              HasSubstr("owned under ownership epoch 0"));
  EXPECT_THAT(error_of([&] { hand_over(st, c.id, moments_of(*c.model, {{0, 2}}, 6), 0, true); }),
              HasSubstr("was owned by node 0 in ownership epoch 0, not by node 2"));
  EXPECT_FALSE(fs::exists(dir.path + "/handoff/moments-node0-epoch0.safetensors"));
  EXPECT_FALSE(fs::exists(dir.path + "/handoff/moments-node2-epoch0.safetensors"));
  EXPECT_EQ(hand_over(st, a.id, lost, 0, true), (std::pair<int64_t, int64_t>{1, 0}));
  fetch.join();
  const ExpertMoments got = moments_from_tensors(fetched, "fetched");
  ASSERT_EQ(got.by_name.size(), 3u);
  EXPECT_EQ(moments_sha256(got), moments_sha256(lost));
}

// A live previous owner that does not hand its moments over: the arrival's fetch waits for
// them as long as a round may wait for a node (round_timeout), then goes on without them.
TEST(MomentsHandoff, AnArrivalWaitsRoundTimeoutForALiveOwnersMomentsThenGoesOnWithout) {
  TempDir dir;
  const Config cfg = arrival_config({"spes_config.round_timeout=0.5"});
  FakeNode a(cfg, 0, 1), b(cfg, 1, 2), c(cfg, 2, 3);
  RoundState st(cfg, ServeOptions{dir.path});
  arrival_round_1(st, a, b);
  arrival_round_2(st, a, b, c);
  ASSERT_EQ(st.ownership_at(3).table, (std::vector<std::vector<int64_t>>{{0, 0, 2, 1}}));
  const auto t0 = std::chrono::steady_clock::now();
  const NamedTensors fetched = st.handed_moments(c.id, 1);
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(fetched.empty());
  EXPECT_GE(waited, 0.45);
  EXPECT_LT(waited, 29.0);  // round_timeout, not the fixed 30 s it once was
}
