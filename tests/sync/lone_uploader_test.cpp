// A lone early uploader (docs/SECURITY.md, finding 4 of issue 35), driven directly on
// RoundState (no gRPC): with the default quorum a round does not close at its deadline on one
// upload while another node is joined and alive (it does once the other is out, and a
// one-node run publishes each round at once); with a quorum of 1 set on purpose, a lone
// upload far above the history of accepted updates is refused though no other upload is there
// to compare it with, and the history survives a restart. The process tests are in
// reliability_e2e_test.cpp (SyncReliability.ALoneEarlyUploader*).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <thread>

#include <nlohmann/json.hpp>

#include "spes/io/files.h"
#include "spes/sync/server/round_state.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;
using ::testing::HasSubstr;

namespace {

const std::string kNorm = "model.layers.0.input_layernorm.weight";  // 8 values, all 1 at start

// Past a deadline of 0.05 s, then the periodic tick.
void tick_after_deadline(RoundState& st) {
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  st.tick();
}

// The node's trainable tensors, the norm weight moved by `by` x its norm.
NamedTensors poisoned(const FakeNode& n, const RoundState& st, double by) {
  NamedTensors t = trained(n, st, 0.001);
  for (auto& [name, v] : t)
    if (name == kNorm) v = v + by * v.norm() / std::sqrt(static_cast<double>(v.numel()));
  return t;
}

}  // namespace

TEST(LoneUploader, ARoundWaitsForASecondUploadWhileAnotherNodeIsAlive) {
  TempDir dir;
  const Config cfg = tiny_config({"spes_config.round_timeout=0.05"});
  ASSERT_EQ(cfg.spes_config.timing.min_nodes, 2);  // the default
  RoundState st(cfg, ServeOptions{dir.path});
  FakeNode a(cfg, 0, 1), b(cfg, 1, 2);
  st.join(a.join_info());
  st.join(b.join_info());
  send_upload(st, a.id, 1, upload_of(a, 1, trained(a, st, 0.001)));
  tick_after_deadline(st);
  EXPECT_EQ(st.published_round(), 0) << "one upload decided the round while node 1 is alive";
  send_upload(st, b.id, 1, upload_of(b, 1, trained(b, st, 0.001)));
  ASSERT_EQ(st.published_round(), 1);
  // Node 1 leaves: it is out, so node 0 alone may close round 2.
  st.leave(b.id, 10, "done");
  send_upload(st, a.id, 2, upload_of(a, 2, trained(a, st, 0.001)));
  tick_after_deadline(st);
  EXPECT_EQ(st.published_round(), 2);
}

TEST(LoneUploader, AOneNodeRunPublishesEachRoundAtOnce) {
  TempDir dir;
  const Config cfg = tiny_config({"spes_config.num_peers=1"});
  RoundState st(cfg, ServeOptions{dir.path});
  FakeNode a(cfg, 0, 1);
  st.join(a.join_info());
  for (int64_t r = 1; r <= 3; ++r) {
    send_upload(st, a.id, r, upload_of(a, r, trained(a, st, 0.001)));
    EXPECT_EQ(st.published_round(), r);
  }
}

TEST(LoneUploader, ALoneUploadFarAboveTheAcceptedUpdatesIsRefusedAlsoAfterARestart) {
  TempDir dir;
  // The operator chose a quorum of 1: a round closes at its deadline on one upload, so only
  // the history of accepted updates can judge it.
  const Config cfg = tiny_config({"spes_config.round_timeout=0.05", "spes_config.min_nodes=1"});
  {
    RoundState st(cfg, ServeOptions{dir.path});
    FakeNode a(cfg, 0, 1), b(cfg, 1, 2);
    st.join(a.join_info());
    st.join(b.join_info());
    send_upload(st, a.id, 1, upload_of(a, 1, trained(a, st, 0.001)));
    send_upload(st, b.id, 1, upload_of(b, 1, trained(b, st, 0.001)));
    ASSERT_EQ(st.published_round(), 1);
  }
  // The server restarts; round 2: node 0 alone moves the norm weight by 4x its norm (inside
  // the per-tensor bound of 10x; no other upload to compare with).
  RoundState st(cfg, ServeOptions{dir.path});
  ASSERT_EQ(st.published_round(), 1);
  FakeNode a(cfg, 0, 3), b(cfg, 1, 4);
  st.join(a.join_info());
  st.join(b.join_info());
  send_upload(st, a.id, 2, upload_of(a, 2, poisoned(a, st, 4.0)));
  tick_after_deadline(st);
  EXPECT_EQ(st.published_round(), 1) << "the lone poisoned upload was published";
  send_upload(st, b.id, 2, upload_of(b, 2, trained(b, st, 0.001)));
  tick_after_deadline(st);
  ASSERT_EQ(st.published_round(), 2);
  st.close();
  const auto rounds = read_jsonl(dir.path + "/rounds.jsonl");
  ASSERT_EQ(rounds.size(), 2u);
  EXPECT_EQ(rounds[1]["nodes"], nlohmann::json::array({1}));
  EXPECT_THAT(rounds[1]["missing"].dump(), HasSubstr("accepted updates"));
}
