// Top-k sparse deltas through the server's round logic (spes_config.compression: topk,
// docs/PROTOCOL.md "Sparse deltas"), driven directly on RoundState: nodes upload their sparse
// payloads with DeltaUpload (variable-size U8 entries), the server rebuilds them, aggregates
// and publishes P_prev + deq(topk(P_agg - P_prev + R)) with its residual R kept in the round
// store, and every node, after taking its own upload as rebuilt and applying the published
// sparse delta stream, holds the published digest, over a merge round too; owner copies are
// published exactly as uploaded; `spes aggregate`'s code on the kept uploads and the kept
// residual reproduces every round; a restarted server takes its residual back and publishes
// what one that was not restarted publishes. Hostile sparse uploads (a NaN scale, bytes left
// over, a payload longer than any valid one, another dtype, the wrong bits) are refused with
// their reason before anything is applied.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>

#include "spes/io/run_layout.h"
#include "spes/sync/node/download.h"
#include "spes/sync/round/aggregate.h"
#include "spes/sync/round/delta_upload.h"
#include "spes/sync/server/round_state.h"
#include "spes/sync/wire/topk_codec.h"
#include "sync/compressed_upload_parts.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

namespace {

const std::string kEmbed = "model.embed_tokens.weight";                      // 128 values
const std::string kOwnExpert = "model.layers.0.mlp.experts.0.gate_proj.weight";  // node 0's

Config topk_config() {
  // Merging at step 20 (round 2) changes every expert.
  return tiny_config({"spes_config.compression=topk", "spes_config.topk_density=0.05",
                      "spes_config.merge_interval=20", "spes_config.merge_alpha_start=0.1",
                      "spes_config.merge_decay_steps=1000", "spes_config.merge_topk=1"});
}

UploadMeta meta_of(const FakeNode& n, int64_t round) {
  UploadMeta m{n.id.node_id, round, round * 10, 80, n.id.incarnation, n.reg->fingerprint()};
  m.compression = Compression::Topk;
  return m;
}

// Trains every trainable tensor a little (different on each node and round).
void train(FakeNode& n, uint64_t seed) {
  torch::NoGradGuard ng;
  torch::manual_seed(seed);
  for (const auto& e : n.reg->entries())
    if (e.trainable) e.tensor.add_(torch::randn(e.tensor.sizes()) * 0.01);
}

std::string stream_bytes(RoundState& st, const NodeId& id, int64_t round, Selection sel,
                         int64_t from_round) {
  auto s = st.begin_download(id, round, sel, 0, from_round);
  std::string all, data;
  uint64_t off = 0;
  while (s->next(&data, &off)) all += data;
  return all;
}

struct Node {
  FakeNode fake;
  DeltaUpload delta;
  Node(const Config& cfg, int64_t id)
      : fake(cfg, id, 11 * (id + 1)),
        delta(Compression::Topk, topk_params(cfg.spes_config.transfer),
              cfg.spes_config.transfer.topk_decay,
              topk_published_params(cfg.spes_config.transfer)) {}
};

// Joins both nodes to `st` and gives them the published model as their base.
std::vector<std::unique_ptr<Node>> joined_nodes(const Config& cfg, RoundState& st) {
  std::vector<std::unique_ptr<Node>> nodes;
  for (int64_t i = 0; i < 2; ++i) {
    nodes.push_back(std::make_unique<Node>(cfg, i));
    st.join(nodes.back()->fake.join_info());
    nodes.back()->fake.download(st, st.published_round(), Selection::All);
    nodes.back()->delta.set_base(*nodes.back()->fake.reg, true);
  }
  return nodes;
}

// One round: both nodes train and upload; each then takes its rebuilt upload, applies the
// published delta stream and must hold the published digest (returned).
std::string do_round(RoundState& st, std::vector<std::unique_ptr<Node>>& nodes, int64_t r) {
  for (auto& n : nodes) {
    train(n->fake, static_cast<uint64_t>(100 * r + n->fake.id.node_id));
    EXPECT_TRUE(send_upload(st, n->fake.id, r, n->delta.encode(*n->fake.reg, meta_of(n->fake, r)))
                    .accepted) << "round " << r;
  }
  EXPECT_EQ(st.published_round(), r);
  const std::string sha = st.status().model_sha256;
  for (auto& n : nodes) {
    n->delta.apply_rebuilt(*n->fake.reg);
    DownloadReceiver rcv(*n->fake.reg, r, Selection::ForNode, WireDtype::F32, &n->delta, r - 1);
    const std::string bytes = stream_bytes(st, n->fake.id, r, Selection::ForNode, r - 1);
    rcv.begin(bytes.size());
    rcv.feed(bytes.data(), bytes.size());
    EXPECT_TRUE(rcv.done() && rcv.is_delta()) << "round " << r;
    EXPECT_EQ(n->fake.reg->weights_sha256(), sha) << "node " << n->fake.id.node_id << " round "
                                                  << r;
    n->delta.set_base(*n->fake.reg, false);
  }
  return sha;
}

torch::Tensor& part(NamedTensors& t, const std::string& name) {
  for (auto& [n, v] : t)
    if (n == name) return v;
  throw std::runtime_error("no part " + name);
}

}  // namespace

TEST(TopkRound, EveryNodeAppliesThePublishedSparseDeltaBitForBitThroughAMerge) {
  TempDir dir;
  const Config cfg = topk_config();
  RoundState st(cfg, ServeOptions{dir.path, /*keep_uploads=*/true});
  auto nodes = joined_nodes(cfg, st);
  const RoundPlan& plan = st.model().plan();
  for (int64_t r = 1; r <= 3; ++r) {
    NamedTensors before;  // copies: named() gives views of the live model
    for (const auto& [name, t] : st.model().named()) before.emplace_back(name, t.clone());
    const std::string sha = do_round(st, nodes, r);
    const nlohmann::json line = st.round_history().back();
    EXPECT_EQ(line["merged"].get<bool>(), r == 2) << "round " << r;
    // The owner copy is its owner's rebuilt upload, bit for bit (merging changes it in round 2).
    const torch::Tensor own = st.model().tensors()[plan.index(kOwnExpert)];
    EXPECT_TRUE(torch::equal(own, nodes[0]->fake.reg->find(kOwnExpert)->tensor));
    // The sparse upload is far below the most a payload may take.
    EXPECT_LT(nodes[0]->delta.upload_data_bytes(*nodes[0]->fake.reg),
              plan.upload_data_bytes(0) / 2);
    // The residual of this round is kept beside it; `spes aggregate`'s code on the kept
    // uploads and the previous round's residual gives the published model exactly.
    const std::string kept = run_layout::kept_residual(dir.path, r);
    ASSERT_TRUE(fs::exists(kept)) << kept;
    SyncModel offline(cfg);
    offline.load(before, "previous");
    if (r > 1)
      ASSERT_TRUE(offline.load_sparse_residual(run_layout::kept_residual(dir.path, r - 1), r - 1,
                                               offline.weights_sha256()));
    aggregate_offline(offline,
                      {run_layout::kept_upload(dir.path, r, 1),
                       run_layout::kept_upload(dir.path, r, 0)},
                      10 * r);
    EXPECT_EQ(offline.weights_sha256(), sha) << "round " << r;
    // Without the residual the round is not reproduced (R is not zero after round 1).
    if (r > 1) {
      SyncModel bare(cfg);
      bare.load(before, "previous");
      aggregate_offline(bare, {run_layout::kept_upload(dir.path, r, 0),
                               run_layout::kept_upload(dir.path, r, 1)}, 10 * r);
      EXPECT_NE(bare.weights_sha256(), sha) << "round " << r;
    }
  }
  // A residual of another round is not taken.
  SyncModel other(cfg);
  EXPECT_FALSE(other.load_sparse_residual(run_layout::kept_residual(dir.path, 2), 1,
                                          other.weights_sha256()));
}

TEST(TopkRound, ADenserWayDownPublishesMoreOfTheAverageAndNodesStillAgreeBitForBit) {
  // topk_down_density 0.2 against uploads at 0.05: the server's change of an averaged tensor
  // may carry 4x the entries of an upload; nodes decode it with the run's published settings.
  TempDir dir;
  const Config cfg = [] {
    Config c = topk_config();
    c.spes_config.transfer.topk_down_density = 0.2;
    return c;
  }();
  RoundState st(cfg, ServeOptions{dir.path});
  auto nodes = joined_nodes(cfg, st);
  const RoundPlan& plan = st.model().plan();
  ASSERT_DOUBLE_EQ(plan.topk().density, 0.05);
  ASSERT_DOUBLE_EQ(plan.topk_published().density, 0.2);
  const int64_t embed = plan.index(kEmbed);
  const torch::Tensor before = st.model().tensors()[embed].clone();
  do_round(st, nodes, 1);  // every node on the published digest (checked inside)
  // The averaged embedding (128 values, one chunk) moved in more places than one upload may
  // carry (ceil(0.05 x 128) = 7), and in no more than the way down allows (ceil(0.2 x 128)).
  const int64_t moved = (st.model().tensors()[embed] != before).sum().item<int64_t>();
  EXPECT_GT(moved, topk_chunk_k(0.05, 128));
  EXPECT_LE(moved, topk_chunk_k(0.2, 128));
  do_round(st, nodes, 2);  // the merge round
  do_round(st, nodes, 3);
  // A node that decodes with the upload's density alone refuses the published stream.
  for (auto& n : nodes) train(n->fake, 400 + n->fake.id.node_id);
  for (auto& n : nodes)
    ASSERT_TRUE(send_upload(st, n->fake.id, 4, n->delta.encode(*n->fake.reg, meta_of(n->fake, 4)))
                    .accepted);
  Node& a = *nodes[0];
  a.delta.apply_rebuilt(*a.fake.reg);
  DeltaUpload upload_only(Compression::Topk, topk_params(cfg.spes_config.transfer));
  upload_only.set_base(*a.fake.reg, true);
  DownloadReceiver rcv(*a.fake.reg, 4, Selection::ForNode, WireDtype::F32, &upload_only, 3);
  const std::string bytes = stream_bytes(st, a.fake.id, 4, Selection::ForNode, 3);
  EXPECT_THAT(error_of([&] {
                rcv.begin(bytes.size());
                rcv.feed(bytes.data(), bytes.size());
              }),
              HasSubstr("topk_density 0.05"));
  // The way up keeps the upload's density: an upload as dense as the way down is refused.
  TempDir up_dir;
  RoundState up(cfg, ServeOptions{up_dir.path});
  auto up_nodes = joined_nodes(cfg, up);
  Node& b = *up_nodes[0];
  DeltaUpload too_dense(Compression::Topk, topk_published_params(cfg.spes_config.transfer));
  too_dense.set_base(*b.fake.reg, true);
  train(b.fake, 7);
  EXPECT_THAT(error_of([&] {
                send_upload(up, b.fake.id, 1, too_dense.encode(*b.fake.reg, meta_of(b.fake, 1)));
              }),
              HasSubstr("allows at most"));
}

TEST(TopkRound, ARestartedServerTakesItsResidualBackAndPublishesTheSameModel) {
  // Two servers on the same uploads: one runs three rounds; the other is stopped after round
  // 2 and resumed from its directory for round 3. Both publish the same round 3.
  const Config cfg = topk_config();
  TempDir a_dir, b_dir;
  std::string sha_a, sha_b;
  {
    RoundState a(cfg, ServeOptions{a_dir.path});
    auto nodes = joined_nodes(cfg, a);
    for (int64_t r = 1; r <= 3; ++r) sha_a = do_round(a, nodes, r);
  }
  auto nodes = [&] {
    RoundState b(cfg, ServeOptions{b_dir.path});
    auto n = joined_nodes(cfg, b);
    for (int64_t r = 1; r <= 2; ++r) do_round(b, n, r);
    return n;
  }();
  ServeOptions resume{b_dir.path};
  resume.resume = true;
  RoundState b(cfg, resume);
  ASSERT_EQ(b.published_round(), 2);
  for (auto& n : nodes) b.join(n->fake.join_info());
  sha_b = do_round(b, nodes, 3);
  EXPECT_EQ(sha_b, sha_a);
  // Without its residual file the resumed server starts R at zero: another model.
  TempDir c_dir;
  auto c_nodes = [&] {
    RoundState c(cfg, ServeOptions{c_dir.path});
    auto n = joined_nodes(cfg, c);
    for (int64_t r = 1; r <= 2; ++r) do_round(c, n, r);
    return n;
  }();
  fs::remove(run_layout::sparse_residual(c_dir.path));
  ServeOptions resume_c{c_dir.path};
  resume_c.resume = true;
  RoundState c(cfg, resume_c);
  for (auto& n : c_nodes) c.join(n->fake.join_info());
  EXPECT_NE(do_round(c, c_nodes, 3), sha_a);
}

TEST(TopkRound, HostileSparseUploadsAreRefusedWithTheirReasonAndChangeNothing) {
  const Config cfg = topk_config();
  const TopkParams p = topk_params(cfg.spes_config.transfer);
  struct Case {
    const char* what;
    std::function<void(NamedTensors&, UploadMeta&)> spoil;
    const char* reason;
  };
  // A payload of the embedding with one byte changed or added.
  auto edit = [&](const std::function<void(std::string&)>& f) {
    return [f](NamedTensors& t, UploadMeta&) {
      std::string s = topk_payload_of(part(t, kEmbed));
      f(s);
      part(t, kEmbed) = topk_payload_tensor(s);
    };
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<Case> cases = {
      {"NaN scale",
       edit([&](std::string& s) { std::memcpy(&s[kTopkFixedHeader + 2], &nan, 4); }),
       "chunk 0: its scale is not finite"},
      {"a byte left over", edit([](std::string& s) { s.push_back('\0'); }),
       "after its last value"},
      {"bits of another run", edit([](std::string& s) { s[1] = 4; }),
       "values of 4 bits where the run uses topk_bits 2"},
      {"more bytes than any valid payload",
       [&](NamedTensors& t, UploadMeta&) {
         part(t, kEmbed) = torch::zeros({static_cast<int64_t>(topk_max_bytes(128, p) + 1)},
                                        torch::kUInt8);
       },
       "a topk payload of a tensor of 128 values is one dimension of 8 to"},
      {"F32 values instead of U8",
       [&](NamedTensors& t, UploadMeta&) { part(t, kEmbed) = torch::zeros({128}); },
       "it is F32, a topk delta carries U8"},
      {"no compression tag",
       [&](NamedTensors&, UploadMeta& m) { m.compression = Compression::None; },
       "says compression 'none'"},
  };
  for (const Case& k : cases) {
    TempDir dir;
    RoundState st(cfg, ServeOptions{dir.path});
    FakeNode a(cfg, 0, 1), b(cfg, 1, 2);
    st.join(a.join_info());
    st.join(b.join_info());
    const std::string sha = st.status().model_sha256;
    NamedTensors t = compressed_upload_parts(a, Compression::Topk, [](const RegistryEntry& e) {
      return torch::full(e.tensor.sizes(), 0.01f);
    });
    UploadMeta m = meta_of(a, 1);
    k.spoil(t, m);
    SyncErrc code = SyncErrc::Internal;
    const std::string why = error_of([&] {
      try {
        send_upload(st, a.id, 1, SafetensorsStreamWriter::as_stored(t, upload_metadata(m)));
      } catch (const SyncError& e) {
        code = e.code();
        throw;
      }
    });
    EXPECT_EQ(code, SyncErrc::InvalidArgument) << k.what << ": " << why;
    EXPECT_THAT(why, HasSubstr(k.reason)) << k.what;
    if (std::string(k.what) != "no compression tag") {
      EXPECT_THAT(why, HasSubstr(kEmbed)) << k.what;
    }
    EXPECT_EQ(st.model().weights_sha256(), sha) << k.what;
    // The honest node's zero change publishes the round without the hostile one: unchanged.
    EXPECT_TRUE(send_upload(st, b.id, 1,
                            SafetensorsStreamWriter::as_stored(
                                compressed_upload_parts(b, Compression::Topk,
                                                        [](const RegistryEntry& e) {
                                                          return torch::zeros_like(e.tensor);
                                                        }),
                                upload_metadata(meta_of(b, 1))))
                    .accepted);
    EXPECT_EQ(st.published_round(), 1) << k.what;
    EXPECT_EQ(st.round_history().back()["nodes"], nlohmann::json::array({1})) << k.what;
    EXPECT_EQ(st.model().weights_sha256(), sha) << k.what;
  }
}
