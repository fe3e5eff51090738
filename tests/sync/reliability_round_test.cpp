// The server's fault handling driven directly on RoundState (no gRPC, no processes): uploads
// that fail a check put their node out of the round and never reach the published model
// (NaN, another node's expert, an update far larger than the bound, an impossible size); a
// replayed old round is refused; a round publishes at its deadline with a quorum, keeps an
// absent owner's experts and averages shared tensors over the nodes present; silent nodes are
// dead and the round stops waiting for them; node tokens; downloads resume from an offset and
// keep serving their round after the next one is published; an interrupted upload resumes from
// the bytes the server kept (dropped when they cannot be used); a repeated chunk is ignored;
// restart from DIR.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "spes/common/error.h"
#include "spes/io/files.h"
#include "spes/io/format_version.h"
#include "spes/model/ownership.h"
#include "spes/sync/round/plan.h"
#include "spes/sync/server/round_state.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
namespace fs = std::filesystem;

namespace {


// A node as the server sees it: its own model, registry and identity.
struct Peer {
  Config cfg;
  std::unique_ptr<Transformer> model;
  std::unique_ptr<ParamRegistry> reg;
  NodeId id;
  Peer(const Config& c, int64_t node, std::string token = "") : cfg(c) {
    model = std::make_unique<Transformer>(cfg.model);
    model->init_weights(static_cast<uint64_t>(100 + node));
    reg = std::make_unique<ParamRegistry>(*model, cfg, Ownership::from_config(cfg), node);
    id = NodeId{node, 7000 + static_cast<uint64_t>(node), std::move(token)};
  }
  JoinInfo join_info() const { return node_join_info(cfg, *reg, id, 0); }
  NamedTensors trainable() const {
    NamedTensors t;
    for (const auto& e : reg->entries())
      if (e.trainable) t.emplace_back(e.name, e.tensor.detach().clone());
    return t;
  }
  SafetensorsStreamWriter upload(int64_t round, NamedTensors t = {}) const {
    if (t.empty()) t = trainable();
    return SafetensorsStreamWriter(std::move(t), torch::kFloat32,
                                   upload_metadata({id.node_id, round, round * 10, 80,
                                                    id.incarnation, reg->fingerprint()}));
  }
  void train(double delta) {
    torch::NoGradGuard ng;
    for (const auto& e : reg->entries())
      if (e.trainable) e.tensor.add_(delta);
  }
  // Downloads (optionally from an offset, in two halves) into the registry.
  void download(RoundState& st, int64_t round, Selection sel, bool in_two_parts = false) {
    std::string bytes;
    {
      auto s = st.begin_download(id, round, sel);
      std::string d;
      uint64_t off = 0;
      const uint64_t half = s->total_bytes() / 2;
      while (s->next(&d, &off)) {
        bytes += d;
        if (in_two_parts && bytes.size() >= half) break;
      }
      if (in_two_parts) bytes.resize(half);  // the connection dropped after `half` bytes
    }
    if (in_two_parts) {
      auto s = st.begin_download(id, round, sel, bytes.size());
      std::string d;
      uint64_t off = 0;
      while (s->next(&d, &off)) {
        EXPECT_EQ(off, bytes.size());
        bytes += d;
      }
    }
    Metadata md;
    for (const auto& [name, t] : safetensors_parse(bytes, &md)) {
      torch::NoGradGuard ng;
      reg->find(name)->tensor.copy_(t);
    }
  }
};

// Joins each peer and gives it the initial model (round 0), as a fresh node starts.
void join_with_initial_model(RoundState& st, std::initializer_list<Peer*> peers) {
  for (Peer* p : peers) {
    st.join(p->join_info());
    p->download(st, 0, Selection::All);
  }
}

torch::Tensor published(const RoundState& st, const std::string& name) {
  return st.model().tensors().at(st.model().plan().index(name)).clone();
}

const std::string kShared = "model.layers.0.self_attn.q_proj.weight";
std::string expert_of(int64_t e) { return expert_param_name(0, e, "gate_proj"); }

}  // namespace

TEST(RoundStateReliability, RejectedUploadsPutTheNodeOutAndNeverReachTheModel) {
  TempDir tmp;
  const Config cfg = tiny_config({"spes_config.max_update_norm_ratio=5"});
  RoundState st(cfg, {tmp.path});
  Peer n0(cfg, 0), n1(cfg, 1);
  join_with_initial_model(st, {&n0, &n1});
  const torch::Tensor expert0_before = published(st, expert_of(0));
  n0.train(0.01);
  n1.train(-0.02);

  // Round 1: node 0's upload carries a NaN: rejected, node 0 is out of round 1.
  NamedTensors bad = n0.trainable();
  bad[0].second.view({-1})[0] = std::nanf("");
  EXPECT_THAT(error_of([&] { send_upload(st, n0.id, 1, n0.upload(1, bad)); }), HasSubstr("NaN"));
  EXPECT_THAT(error_of([&] { send_upload(st, n0.id, 1, n0.upload(1)); }),
              HasSubstr("was rejected"));  // no second chance in the same round
  // Node 1 arrives: every node has arrived or is out, so the round publishes without waiting
  // for a deadline, over node 1 alone.
  EXPECT_TRUE(send_upload(st, n1.id, 1, n1.upload(1)).accepted);
  const RoundStatus r1 = st.wait_round(n1.id, 1, 10);
  ASSERT_TRUE(r1.published);
  EXPECT_THAT(r1.nodes, ElementsAre(1));
  EXPECT_TRUE(torch::isfinite(st.model().tensors()[0]).all().item<bool>());
  EXPECT_TRUE(torch::equal(published(st, expert_of(0)), expert0_before));  // owner absent
  EXPECT_TRUE(torch::equal(published(st, kShared),
                           n1.reg->find(kShared)->tensor.detach()));  // mean over node 1 alone
  // Node 0 was out: it takes the whole published model and holds the published digest.
  n0.download(st, 1, Selection::All);
  n1.download(st, 1, Selection::ForNode);
  EXPECT_EQ(n0.reg->weights_sha256(), r1.model_sha256);
  EXPECT_EQ(n1.reg->weights_sha256(), r1.model_sha256);

  // Round 2: node 1 uploads node 0's expert: rejected (it may upload only its own experts).
  n0.train(0.01);
  n1.train(0.01);
  {
    NamedTensors t = n1.trainable();
    t.emplace_back(expert_of(0), n1.reg->find(expert_of(0))->tensor.detach().clone());
    EXPECT_THAT(error_of([&] { send_upload(st, n1.id, 2, n1.upload(2, t)); }),
                HasSubstr("may not upload '" + expert_of(0) + "'"));
  }
  EXPECT_TRUE(send_upload(st, n0.id, 2, n0.upload(2)).accepted);
  const RoundStatus r2 = st.wait_round(n0.id, 2, 10);
  ASSERT_TRUE(r2.published);
  EXPECT_THAT(r2.nodes, ElementsAre(0));
  n0.download(st, 2, Selection::ForNode);
  n1.download(st, 2, Selection::All);
  EXPECT_EQ(n0.reg->weights_sha256(), r2.model_sha256);
  EXPECT_EQ(n1.reg->weights_sha256(), r2.model_sha256);

  // Round 3: node 0's update is 1000x the model (above max_update_norm_ratio=5); an upload
  // declaring an impossible size is refused up front. Both nodes are out: round 3 publishes the
  // model unchanged, with neither's values.
  {
    NamedTensors t = n0.trainable();
    for (auto& [name, v] : t) v.mul_(1000);
    EXPECT_THAT(error_of([&] { send_upload(st, n0.id, 3, n0.upload(3, t)); }),
                HasSubstr("max_update_norm_ratio"));
  }
  EXPECT_EQ(code_of([&] { st.begin_upload(n1.id, 3, 30, 1ull << 40); }),
            SyncErrc::ResourceExhausted);
  st.tick();
  const RoundStatus r3 = st.wait_round(n0.id, 3, 10);
  ASSERT_TRUE(r3.published);
  EXPECT_TRUE(r3.nodes.empty());
  EXPECT_EQ(r3.model_sha256, r2.model_sha256);
  EXPECT_EQ(st.model().weights_sha256(), r2.model_sha256);

  // A replay of an old round is refused as closed, and never applied.
  EXPECT_EQ(code_of([&] { send_upload(st, n0.id, 1, n0.upload(1)); }), SyncErrc::OutOfRange);
  EXPECT_EQ(st.model().weights_sha256(), r2.model_sha256);

  st.close();
  const auto lines = read_jsonl(tmp.path + "/rounds.jsonl");
  ASSERT_EQ(lines.size(), 3u);
  ASSERT_EQ(lines[0]["missing"].size(), 1u);
  EXPECT_EQ(lines[0]["missing"][0]["node"], 0);
  EXPECT_THAT(lines[0]["missing"][0]["reason"].get<std::string>(), HasSubstr("rejected: "));
  EXPECT_THAT(lines[0]["missing"][0]["reason"].get<std::string>(), HasSubstr("NaN"));
  EXPECT_THAT(lines[1]["missing"][0]["reason"].get<std::string>(), HasSubstr("may not upload"));
  EXPECT_EQ(lines[0]["node_states"][0], "rejected");
  EXPECT_TRUE(lines[2]["nodes"].empty());
  EXPECT_EQ(lines[2]["missing"].size(), 2u);
}

TEST(RoundStateReliability, DeadlinePublishesWithQuorumAndRefusesTheStraggler) {
  TempDir tmp;
  const Config cfg = tiny_config({"spes_config.round_timeout=0.3", "spes_config.min_nodes=1"});
  RoundState st(cfg, {tmp.path});
  Peer n0(cfg, 0), n1(cfg, 1);
  join_with_initial_model(st, {&n0, &n1});
  const torch::Tensor expert2_before = published(st, expert_of(2));
  n0.train(0.01);
  n1.train(0.05);
  EXPECT_TRUE(send_upload(st, n0.id, 1, n0.upload(1)).accepted);
  st.tick();
  EXPECT_FALSE(st.wait_round(n0.id, 1, 10).published) << "published before the deadline";
  std::this_thread::sleep_for(std::chrono::milliseconds(350));
  st.tick();
  const RoundStatus r = st.wait_round(n0.id, 1, 10);
  ASSERT_TRUE(r.published);
  EXPECT_THAT(r.nodes, ElementsAre(0));
  // Node 1 (the owner of experts 2-3) was missing: its experts keep their published value;
  // shared tensors are node 0's (the mean over the nodes present).
  EXPECT_TRUE(torch::equal(published(st, expert_of(2)), expert2_before));
  EXPECT_TRUE(torch::equal(published(st, kShared), n0.reg->find(kShared)->tensor.detach()));
  // The straggler's upload arrives after the deadline: refused as closed, never applied.
  const std::string sha = st.model().weights_sha256();
  EXPECT_EQ(code_of([&] { send_upload(st, n1.id, 1, n1.upload(1)); }), SyncErrc::OutOfRange);
  EXPECT_EQ(st.model().weights_sha256(), sha);
  n1.download(st, 1, Selection::ForNode);  // not in the round: it gets its own experts back
  EXPECT_EQ(n1.reg->weights_sha256(), sha);
  st.close();
  const auto lines = read_jsonl(tmp.path + "/rounds.jsonl");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0]["missing"][0]["node"], 1);
  EXPECT_EQ(lines[0]["missing"][0]["reason"], "timeout");

  // Without a quorum the deadline does not publish.
  TempDir tmp2;
  const Config cfg2 = tiny_config({"spes_config.round_timeout=0.1", "spes_config.min_nodes=2"});
  RoundState st2(cfg2, {tmp2.path});
  Peer m0(cfg2, 0), m1(cfg2, 1);
  st2.join(m0.join_info());
  st2.join(m1.join_info());
  m0.download(st2, 0, Selection::All);
  EXPECT_TRUE(send_upload(st2, m0.id, 1, m0.upload(1)).accepted);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  st2.tick();
  EXPECT_FALSE(st2.wait_round(m0.id, 1, 10).published);
}

TEST(RoundStateReliability, SilentNodeIsDeadAndTheRoundStopsWaitingForIt) {
  TempDir tmp;
  const Config cfg = tiny_config({"spes_config.heartbeat_timeout=0.2"});
  RoundState st(cfg, {tmp.path});
  Peer n0(cfg, 0), n1(cfg, 1);
  st.join(n0.join_info());
  st.join(n1.join_info());
  n0.download(st, 0, Selection::All);
  EXPECT_EQ(st.status().nodes[1].state, "training");
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  st.heartbeat(n0.id, 5);
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  const ServerStatus s = st.status();
  EXPECT_EQ(s.nodes[0].state, "training");
  EXPECT_EQ(s.nodes[0].step, 5);
  EXPECT_EQ(s.nodes[1].state, "dead");
  EXPECT_GT(s.nodes[1].last_seen_s, 0.2);
  // Node 0 uploads; node 1 is dead, so the round publishes without waiting for the deadline.
  EXPECT_TRUE(send_upload(st, n0.id, 1, n0.upload(1)).accepted);
  ASSERT_TRUE(st.wait_round(n0.id, 1, 10).published);
  st.close();
  const auto lines = read_jsonl(tmp.path + "/rounds.jsonl");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0]["missing"][0]["reason"], "dead");
  EXPECT_EQ(lines[0]["node_states"][1], "dead");
}

// After the run's last round (max_duration 20 = round 2) a dead node no longer keeps the server
// running, and neither does a node that a server restarted after the run never sees again;
// before the last round a dead node does.
TEST(RoundStateReliability, AfterTheRunsLastRoundADeadOrAbsentNodeDoesNotKeepTheServerRunning) {
  TempDir tmp;
  const Config cfg = tiny_config({"spes_config.heartbeat_timeout=0.2", "max_duration=20"});
  {
    RoundState st(cfg, {tmp.path});
    Peer n0(cfg, 0), n1(cfg, 1);
    join_with_initial_model(st, {&n0, &n1});
    n0.train(0.01);
    n1.train(0.02);
    send_upload(st, n0.id, 1, n0.upload(1));
    send_upload(st, n1.id, 1, n1.upload(1));
    ASSERT_EQ(st.published_round(), 1);
    // Node 1 falls silent: dead, but round 2 is still to come.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    st.heartbeat(n0.id, 15);
    ASSERT_EQ(st.status().nodes[1].state, "dead");
    EXPECT_FALSE(st.all_left());
    send_upload(st, n0.id, 2, n0.upload(2));
    ASSERT_EQ(st.published_round(), 2);  // the run's last
    EXPECT_FALSE(st.all_left());         // node 0 is training and has not left
    st.leave(n0.id, 20, "finished");
    EXPECT_TRUE(st.all_left());
    EXPECT_THAT(st.gone_without_leaving(), ElementsAre(1));
    st.close();
  }
  // Restarted on DIR after the run: nobody joins within heartbeat_timeout, and the server is
  // done; a node that joins in time holds it until it leaves.
  {
    RoundState st(cfg, {tmp.path});
    ASSERT_EQ(st.published_round(), 2);
    EXPECT_FALSE(st.all_left());
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    EXPECT_TRUE(st.all_left());
    EXPECT_THAT(st.gone_without_leaving(), ElementsAre(0, 1));
    Peer n0(cfg, 0);
    st.join(n0.join_info());
    EXPECT_FALSE(st.all_left());
    st.leave(n0.id, 20, "finished");
    EXPECT_TRUE(st.all_left());
    EXPECT_THAT(st.gone_without_leaving(), ElementsAre(1));
  }
  // Before the last round (max_duration 30) the same silence keeps the server waiting.
  TempDir tmp2;
  const Config longer = tiny_config({"spes_config.heartbeat_timeout=0.2", "max_duration=30"});
  RoundState st(longer, {tmp2.path});
  Peer n0(longer, 0), n1(longer, 1);
  join_with_initial_model(st, {&n0, &n1});
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  st.leave(n0.id, 0, "finished");
  EXPECT_EQ(st.status().nodes[1].state, "dead");
  EXPECT_FALSE(st.all_left());
  EXPECT_TRUE(st.gone_without_leaving().empty());
}

TEST(RoundStateReliability, DownloadsResumeAndSurviveTheNextPublication) {
  TempDir tmp;
  const Config cfg = tiny_config();
  RoundState st(cfg, {tmp.path});
  Peer n0(cfg, 0), n1(cfg, 1);
  st.join(n0.join_info());
  st.join(n1.join_info());
  n0.download(st, 0, Selection::All, /*in_two_parts=*/true);
  EXPECT_EQ(n0.reg->weights_sha256(), st.model().weights_sha256());
  n1.download(st, 0, Selection::All);
  n0.train(0.01);
  n1.train(0.02);
  send_upload(st, n0.id, 1, n0.upload(1));
  send_upload(st, n1.id, 1, n1.upload(1));
  const std::string sha1 = st.wait_round(n0.id, 1, 10).model_sha256;
  // A download of round 1 begun before round 2 is published still serves round 1's bytes
  // (it reads the file it opened, which the next publication renames over).
  auto s = st.begin_download(n1.id, 1, Selection::All);
  std::string bytes, d;
  uint64_t off = 0;
  n0.download(st, 1, Selection::ForNode, /*in_two_parts=*/true);
  EXPECT_EQ(n0.reg->weights_sha256(), sha1);
  n0.train(0.01);
  n1.train(0.01);
  send_upload(st, n0.id, 2, n0.upload(2));
  send_upload(st, n1.id, 2, n1.upload(2));
  ASSERT_TRUE(st.wait_round(n0.id, 2, 10).published);
  while (s->next(&d, &off)) bytes += d;
  Metadata md;
  safetensors_parse(bytes, &md);
  EXPECT_EQ(md.at("model_sha256"), sha1);
  EXPECT_EQ(md.at("round"), "1");
  // Resuming past the end is refused.
  EXPECT_EQ(code_of([&] { st.begin_download(n0.id, 2, Selection::All, 1ull << 40); }),
            SyncErrc::OutOfRange);
}

TEST(RoundStateReliability, RestartContinuesFromTheLastPublishedRound) {
  TempDir tmp;
  const Config cfg = tiny_config();
  std::string sha1;
  Peer n0(cfg, 0), n1(cfg, 1);
  {
    RoundState st(cfg, {tmp.path});
    st.join(n0.join_info());
    st.join(n1.join_info());
    n0.download(st, 0, Selection::All);
    n1.download(st, 0, Selection::All);
    n0.train(0.01);
    n1.train(0.02);
    send_upload(st, n0.id, 1, n0.upload(1));
    send_upload(st, n1.id, 1, n1.upload(1));
    sha1 = st.wait_round(n0.id, 1, 10).model_sha256;
    // Node 0's round 2 upload is accepted, then the server dies before publishing round 2
    // (this object goes away without downloads completing).
    n0.train(0.01);
    send_upload(st, n0.id, 2, n0.upload(2));
  }
  RoundState st(cfg, {tmp.path});
  EXPECT_EQ(st.published_round(), 1);
  EXPECT_EQ(st.model().weights_sha256(), sha1);
  // The restarted server knows no node: they join again, and round 2 is collected afresh.
  EXPECT_EQ(code_of([&] { send_upload(st, n0.id, 2, n0.upload(2)); }), SyncErrc::NotJoined);
  const JoinResult jr = st.join(n0.join_info());
  EXPECT_EQ(jr.published_round, 1);
  EXPECT_EQ(jr.model_sha256, sha1);
  EXPECT_THAT(jr.published_nodes, ElementsAre(0, 1));
  st.join(n1.join_info());
  EXPECT_EQ(code_of([&] { send_upload(st, n0.id, 1, n0.upload(1)); }), SyncErrc::OutOfRange);
  EXPECT_TRUE(send_upload(st, n0.id, 2, n0.upload(2)).accepted);
  n1.train(0.01);
  EXPECT_TRUE(send_upload(st, n1.id, 2, n1.upload(2)).accepted);
  ASSERT_TRUE(st.wait_round(n0.id, 2, 10).published);
  st.close();
  // rounds.jsonl: each round exactly once (round 1 recovered from state.json if its line had
  // not been written yet).
  const auto lines = read_jsonl(tmp.path + "/rounds.jsonl");
  std::vector<int64_t> rounds;
  for (const auto& l : lines) rounds.push_back(l["round"]);
  EXPECT_THAT(rounds, ElementsAre(1, 2));
  // close() waited for the background cleanup: no replaced model file, no temporary file, no
  // staged upload of a published round is left.
  for (const auto& e : fs::recursive_directory_iterator(tmp.path)) {
    const std::string name = e.path().filename().string();
    EXPECT_EQ(name.find(".tmp."), std::string::npos) << e.path();
    EXPECT_NE(e.path().parent_path().filename(), "staging") << e.path();
  }

  // A corrupt published file is detected, not served.
  {
    std::fstream f(tmp.path + "/published.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');
  }
  EXPECT_THAT(error_of([&] { RoundState again(cfg, {tmp.path}); }), HasSubstr("is corrupt"));
  // Starting over is explicit.
  ServeOptions fresh{tmp.path};
  fresh.resume = false;
  RoundState over(cfg, fresh);
  EXPECT_EQ(over.published_round(), 0);
}

TEST(RoundStateReliability, ADirectoryWithTheEarlierFlatDigestResumes) {
  // Servers of sync protocol 1-4 named the model by one SHA-256 over all weights; a directory
  // they wrote resumes, under this version's per-tensor digest.
  TempDir tmp;
  const Config cfg = tiny_config();
  std::string now, flat;
  {
    RoundState st(cfg, {tmp.path});
    now = st.model().weights_sha256();
    flat = st.model().flat_weights_sha256();
    st.close();
  }
  ASSERT_NE(now, flat);
  for (const std::string name : {"/published.safetensors", "/state.json"}) {
    std::string bytes = file_read(tmp.path + name);
    const size_t at = bytes.find(now);
    ASSERT_NE(at, std::string::npos) << name;
    bytes.replace(at, now.size(), flat);
    std::ofstream(tmp.path + name, std::ios::binary | std::ios::trunc) << bytes;
  }
  RoundState again(cfg, {tmp.path});
  EXPECT_EQ(again.published_round(), 0);
  EXPECT_EQ(again.status().model_sha256, now);
  again.close();
  // Any other digest is still a corrupt file (the resumed file still names the flat one).
  std::string bytes = file_read(tmp.path + "/published.safetensors");
  const size_t at = bytes.find(flat);
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 4, "0000");
  std::ofstream(tmp.path + "/published.safetensors", std::ios::binary | std::ios::trunc) << bytes;
  EXPECT_THAT(error_of([&] { RoundState bad(cfg, {tmp.path}); }), HasSubstr("is corrupt"));
}

TEST(RoundStateReliability, RepeatedUploadIsNeverAppliedTwice) {
  TempDir tmp;
  const Config cfg = tiny_config();
  RoundState st(cfg, {tmp.path});
  Peer n0(cfg, 0), n1(cfg, 1);
  join_with_initial_model(st, {&n0, &n1});
  n0.train(0.01);
  n1.train(0.03);
  const NamedTensors first = n0.trainable();
  EXPECT_FALSE(send_upload(st, n0.id, 1, n0.upload(1)).duplicate);
  // A retry by the same process (its reply was lost): acknowledged, ignored.
  const UploadResult retry = send_upload(st, n0.id, 1, n0.upload(1));
  EXPECT_TRUE(retry.duplicate);
  EXPECT_TRUE(retry.accepted);
  // Node 0 restarts (new incarnation), trains again from its checkpoint and sends round 1
  // again: the first upload counts; this one is reported as not applied.
  n0.id.incarnation += 1;
  st.join(n0.join_info());
  n0.train(0.5);
  const UploadResult again = send_upload(st, n0.id, 1, n0.upload(1));
  EXPECT_TRUE(again.duplicate);
  EXPECT_FALSE(again.accepted);
  send_upload(st, n1.id, 1, n1.upload(1));
  const RoundStatus r = st.wait_round(n1.id, 1, 10);
  ASSERT_TRUE(r.published);
  EXPECT_THAT(r.nodes, ElementsAre(0, 1));
  // Shared tensors: the mean of node 0's first upload and node 1's.
  torch::Tensor want;
  for (const auto& [name, t] : first)
    if (name == kShared) want = (t + n1.reg->find(kShared)->tensor.detach()) / 2;
  EXPECT_TRUE(torch::allclose(published(st, kShared), want, 0, 1e-7));
}

namespace {

// Node `p`'s round-1 upload as bytes, and a stream of it cut off: chunks of 1000 bytes from
// `from` to `upto`, then the session ends without finish() (the connection broke).
std::string upload_bytes(const Peer& p, int64_t round) {
  const SafetensorsStreamWriter w = p.upload(round);
  std::string bytes;
  w.read(0, w.total_bytes(), &bytes);
  return bytes;
}

void send_range(UploadSession& s, const std::string& bytes, uint64_t from, uint64_t upto) {
  for (uint64_t off = from; off < upto; off += 1000) {
    const std::string piece = bytes.substr(off, std::min<uint64_t>(1000, upto - off));
    s.chunk(off, piece, chunk_checksum(piece));
  }
}

void interrupted_upload(RoundState& st, const NodeId& id, const std::string& bytes,
                        uint64_t upto) {
  auto s = st.begin_upload(id, 1, 10, bytes.size());
  send_range(*s, bytes, 0, upto);
}

// Whether DIR/staging still holds a partial upload file.
bool staging_has_partial(const std::string& dir) {
  for (const auto& e : fs::directory_iterator(dir + "/staging"))
    if (e.path().filename().string().find(".partial") != std::string::npos) return true;
  return false;
}

}  // namespace

TEST(RoundStateReliability, InterruptedUploadResumesFromTheBytesTheServerKept) {
  TempDir tmp;
  const Config cfg = tiny_config();
  RoundState st(cfg, {tmp.path});
  Peer n0(cfg, 0), n1(cfg, 1);
  join_with_initial_model(st, {&n0, &n1});
  n0.train(0.01);
  n1.train(0.03);
  const std::string bytes = upload_bytes(n0, 1);
  const uint64_t total = bytes.size(), cut = total / 2 / 1000 * 1000;
  ASSERT_GT(cut, 0u);
  interrupted_upload(st, n0.id, bytes, cut);
  // The server kept the verified bytes of the broken stream, for this upload only.
  EXPECT_EQ(st.upload_resume_offset(n0.id, 1, 10, total), cut);
  EXPECT_EQ(st.upload_resume_offset(n0.id, 1, 10, total + 8), 0u);
  // A resume past what the server holds is refused; the kept bytes stay.
  EXPECT_EQ(code_of([&] { st.begin_upload(n0.id, 1, 10, total, cut + 1000); }),
            SyncErrc::DataLoss);
  EXPECT_EQ(st.upload_resume_offset(n0.id, 1, 10, total), cut);
  UploadResult r;
  {
    auto s = st.begin_upload(n0.id, 1, 10, total, cut);
    send_range(*s, bytes, cut, total);
    r = s->finish(chunk_checksum(bytes));
  }
  EXPECT_TRUE(r.accepted);
  EXPECT_FALSE(r.duplicate);
  EXPECT_EQ(r.resumed_from, cut);
  EXPECT_EQ(r.bytes, total);
  EXPECT_EQ(r.checksum, chunk_checksum(bytes));
  EXPECT_TRUE(send_upload(st, n1.id, 1, n1.upload(1)).accepted);
  const RoundStatus r1 = st.wait_round(n1.id, 1, 10);
  ASSERT_TRUE(r1.published);
  EXPECT_THAT(r1.nodes, ElementsAre(0, 1));
  // The resumed upload counts exactly like an uninterrupted one.
  const torch::Tensor want = (n0.reg->find(kShared)->tensor.detach() +
                              n1.reg->find(kShared)->tensor.detach()) / 2;
  EXPECT_TRUE(torch::allclose(published(st, kShared), want, 0, 1e-7));
  st.close();
  const auto lines = read_jsonl(tmp.path + "/rounds.jsonl");
  ASSERT_EQ(lines.size(), 1u);
  const auto& l = lines[0];
  EXPECT_EQ(l["bytes_in_per_node"][0], total);
  EXPECT_EQ(l["bytes_in_wire_per_node"][0], total);  // no byte of node 0 arrived twice
  EXPECT_EQ(l["bytes_in_resumed_per_node"][0], cut);
  EXPECT_EQ(l["bytes_in_wire_per_node"][1], l["bytes_in_per_node"][1]);
  EXPECT_EQ(l["bytes_in_resumed_per_node"][1], 0);
}

TEST(RoundStateReliability, KeptUploadBytesAreDroppedWhenTheyCannotBeUsed) {
  TempDir tmp;
  const Config cfg = tiny_config({"spes_config.round_timeout=0.2", "spes_config.min_nodes=1"});
  RoundState st(cfg, {tmp.path});
  Peer n0(cfg, 0), n1(cfg, 1);
  join_with_initial_model(st, {&n0, &n1});
  n0.train(0.01);
  const std::string bytes = upload_bytes(n0, 1);
  const uint64_t total = bytes.size();
  // A corrupt chunk breaks the stream; the chunks before it are kept.
  {
    auto s = st.begin_upload(n0.id, 1, 10, total);
    send_range(*s, bytes, 0, 2000);
    EXPECT_EQ(code_of([&] { s->chunk(2000, bytes.substr(2000, 1000), chunk_checksum("x")); }),
              SyncErrc::DataLoss);
  }
  EXPECT_EQ(st.upload_resume_offset(n0.id, 1, 10, total), 2000u);
  // A resumed stream must end with the digest of the whole stream, the right one: otherwise
  // the kept bytes are dropped and the node sends everything again.
  for (const std::string& digest : {std::string(), chunk_checksum("another stream")}) {
    {
      auto s = st.begin_upload(n0.id, 1, 10, total, 2000);
      send_range(*s, bytes, 2000, total);
      EXPECT_EQ(code_of([&] { s->finish(digest); }), SyncErrc::DataLoss);
    }
    EXPECT_EQ(st.upload_resume_offset(n0.id, 1, 10, total), 0u);
    EXPECT_EQ(code_of([&] { st.begin_upload(n0.id, 1, 10, total, 2000); }), SyncErrc::DataLoss);
    interrupted_upload(st, n0.id, bytes, 2000);
  }
  // A new stream from offset 0 replaces the kept bytes.
  interrupted_upload(st, n0.id, bytes, 1000);
  EXPECT_EQ(st.upload_resume_offset(n0.id, 1, 10, total), 1000u);
  // The node restarts (new incarnation): what the old process sent is dropped.
  n0.id.incarnation += 1;
  st.join(n0.join_info());
  EXPECT_EQ(st.upload_resume_offset(n0.id, 1, 10, total), 0u);
  EXPECT_FALSE(staging_has_partial(tmp.path));
  // The round publishes (deadline, node 1 alone): the kept bytes of round 1 are dropped.
  interrupted_upload(st, n0.id, upload_bytes(n0, 1), 2000);
  EXPECT_TRUE(staging_has_partial(tmp.path));
  n1.train(0.02);
  EXPECT_TRUE(send_upload(st, n1.id, 1, n1.upload(1)).accepted);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  st.tick();
  const RoundStatus r1 = st.wait_round(n1.id, 1, 10);
  ASSERT_TRUE(r1.published);
  EXPECT_THAT(r1.nodes, ElementsAre(1));
  EXPECT_FALSE(staging_has_partial(tmp.path));
  EXPECT_EQ(code_of([&] { st.begin_upload(n0.id, 1, 10, total, 2000); }), SyncErrc::DataLoss);
}

TEST(RoundStateReliability, RepeatedChunkIsNeverAppliedTwice) {
  TempDir tmp;
  const Config cfg = tiny_config();
  RoundState st(cfg, {tmp.path});
  Peer n0(cfg, 0), n1(cfg, 1);
  join_with_initial_model(st, {&n0, &n1});
  n0.train(0.01);
  n1.train(0.03);
  const std::string bytes = upload_bytes(n0, 1);
  const uint64_t total = bytes.size();
  ASSERT_GT(total, 3000u);
  UploadResult r;
  {
    auto s = st.begin_upload(n0.id, 1, 10, total);
    send_range(*s, bytes, 0, 2000);
    send_range(*s, bytes, 1000, 2000);  // chunk 1 again
    send_range(*s, bytes, 0, 1000);     // chunk 0 again
    const std::string overlap = bytes.substr(1500, 1000);  // [1500, 2500): 500 new bytes
    s->chunk(1500, overlap, chunk_checksum(overlap));
    send_range(*s, bytes, 2500, total);
    r = s->finish(chunk_checksum(bytes));
  }
  EXPECT_TRUE(r.accepted);
  EXPECT_EQ(r.bytes, total);
  EXPECT_EQ(r.checksum, chunk_checksum(bytes));  // the stream as assembled is the one sent
  EXPECT_TRUE(send_upload(st, n1.id, 1, n1.upload(1)).accepted);
  const RoundStatus r1 = st.wait_round(n1.id, 1, 10);
  ASSERT_TRUE(r1.published);
  const torch::Tensor want = (n0.reg->find(kShared)->tensor.detach() +
                              n1.reg->find(kShared)->tensor.detach()) / 2;
  EXPECT_TRUE(torch::allclose(published(st, kShared), want, 0, 1e-7));
  st.close();
  const auto lines = read_jsonl(tmp.path + "/rounds.jsonl");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0]["bytes_in_per_node"][0], total);
  // Received on the wire: the repeats (chunks 1 and 0) and the overlap's old half on top.
  EXPECT_EQ(lines[0]["bytes_in_wire_per_node"][0], total + 2000 + 500);
}

// The version rule (io/format_version.h) on the server's directory: state.json written by a
// newer spes is refused with both versions before anything is loaded; the directory is kept.
TEST(RoundStateReliability, ADirectoryOfANewerFormatIsRefusedAndKept) {
  TempDir tmp;
  const Config cfg = tiny_config();
  { RoundState st(cfg, {tmp.path}); }
  const std::string state = tmp.path + "/state.json";
  nlohmann::json st = nlohmann::json::parse(file_read(state));
  st["format"] = format_name(kServerStateFormat, kServerStateFormatVersion + 1);
  file_write_atomic(state, st.dump());
  EXPECT_THAT(error_of([&] { RoundState again(cfg, {tmp.path}); }),
              HasSubstr("by a newer spes; this spes reads spes-server-state up to version"));
  EXPECT_EQ(nlohmann::json::parse(file_read(state))["format"], st["format"]);
}
