// Payload framing (streamed safetensors, chunk checksums) and the server's round state machine
// driven directly, without gRPC: fingerprint and settings checks on join, refused uploads
// (corrupt chunk, wrong round) that never reach the published model, a full round with out-of-order arrivals, downloads that leave every node with the
// published digest, byte counts against the S + X/N formula, rounds.jsonl and kept uploads
// that `spes aggregate`'s code reproduces byte for byte.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <random>

#include "spes/cluster/run_report.h"
#include "spes/common/error.h"
#include "spes/io/files.h"
#include "spes/model/ownership.h"
#include "spes/sync/round/plan.h"
#include "spes/sync/server/round_state.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

namespace {

std::string all_bytes(const SafetensorsStreamWriter& w) {
  std::string s;
  w.read(0, w.total_bytes(), &s);
  return s;
}

NamedTensors sample_tensors() {
  torch::manual_seed(3);
  return {{"a", torch::randn({3, 5})},
          {"empty", torch::zeros({0, 4})},
          {"b", torch::randn({7})},
          {"c", torch::randn({2, 2, 3})}};
}

}  // namespace

// ---- framing -------------------------------------------------------------------------------
TEST(Framing, StreamWriterEmitsSafetensorsBytesInAnySlices) {
  const NamedTensors t = sample_tensors();
  const Metadata md = {{"format", "x"}, {"round", "3"}};
  SafetensorsStreamWriter w(t, torch::kFloat32, md);
  const std::string want = safetensors_serialize(t, md);
  EXPECT_EQ(all_bytes(w), want);
  // Arbitrary slice boundaries (inside the header, inside elements) give the same bytes.
  std::string pieces;
  for (uint64_t off = 0, n = 1; off < w.total_bytes(); off += n, n = n * 3 % 17 + 1)
    w.read(off, n, &pieces);
  EXPECT_EQ(pieces, want);
  // bf16 on the wire: the bytes of the bf16-converted tensors.
  NamedTensors bf;
  for (const auto& [n, x] : t) bf.emplace_back(n, x.to(torch::kBFloat16));
  EXPECT_EQ(all_bytes(SafetensorsStreamWriter(t, torch::kBFloat16, md)),
            safetensors_serialize(bf, md));
}

// A stream served from a file (downloads read the published file): a subset of its tensors in
// another order, as stored (read straight into the output) or converted to bf16, gives the bytes
// of the same stream built from memory, whatever the slice boundaries.
TEST(Framing, StreamWriterFromFileEqualsTheInMemoryStreamInAnySlices) {
  const NamedTensors t = sample_tensors();
  const TempDir dir;
  const std::string path = dir.path + "/model.safetensors";
  file_write_atomic(path, safetensors_serialize(t, {{"format", "stored"}}));
  const Metadata md = {{"format", "x"}};
  const NamedTensors subset = {t[3], t[1], t[0]};  // c, empty, a
  for (torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const SafetensorsStreamWriter w =
        SafetensorsStreamWriter::from_file(path, {"c", "empty", "a"}, dtype, md);
    const std::string want = all_bytes(SafetensorsStreamWriter(subset, dtype, md));
    EXPECT_EQ(all_bytes(w), want);
    for (uint64_t step : {1, 3, 5, 64}) {
      std::string pieces;
      for (uint64_t off = 0, n = 1; off < w.total_bytes(); off += n, n = n * step % 29 + 1)
        w.read(off, n, &pieces);
      EXPECT_EQ(pieces, want) << "slices varied with step " << step;
    }
    // Appends to what `out` holds already.
    std::string out = "prefix";
    w.read(w.header_bytes() + 2, 9, &out);
    EXPECT_EQ(out, "prefix" + want.substr(w.header_bytes() + 2, 9));
  }
}

TEST(Framing, StreamReaderRoundTripFedInPieces) {
  const NamedTensors t = sample_tensors();
  const std::string bytes = safetensors_serialize(t, {{"k", "v"}});
  for (size_t piece : {size_t(1), size_t(5), size_t(64), bytes.size()}) {
    NamedTensors got;
    Metadata md;
    SafetensorsStreamReader r(
        bytes.size(), "test", [&](const StreamHeader& h) { md = h.metadata; },
        [&](const StreamEntry& e, const torch::Tensor& x) { got.emplace_back(e.name, x); });
    for (size_t off = 0; off < bytes.size(); off += piece)
      r.feed(bytes.data() + off, std::min(piece, bytes.size() - off));
    r.finish();
    ASSERT_EQ(got.size(), t.size()) << piece;
    for (size_t i = 0; i < t.size(); ++i) {
      EXPECT_EQ(got[i].first, t[i].first);
      EXPECT_TRUE(torch::equal(got[i].second, t[i].second));
    }
    EXPECT_EQ(md.at("k"), "v");
  }
}

TEST(Framing, SliceModeHandsOutRunsOfWholeElements) {
  const NamedTensors t = sample_tensors();
  const std::string bytes = all_bytes(SafetensorsStreamWriter(t, torch::kBFloat16, {}));
  for (size_t piece : {size_t(1), size_t(3), size_t(7), size_t(1000)}) {
    std::map<std::string, torch::Tensor> got;
    std::map<std::string, int> lasts;
    SafetensorsStreamReader r(bytes.size(), "test", nullptr, nullptr);
    r.set_slice_handler([&](const StreamEntry& e, int64_t first, const torch::Tensor& run,
                            bool last) {
      auto& g = got[e.name];
      if (!g.defined()) g = torch::full({e.end - e.begin > 0 ? static_cast<int64_t>(
                                             (e.end - e.begin) / 2) : 0}, -1.0, torch::kBFloat16);
      ASSERT_EQ(run.dim(), 1);
      g.slice(0, first, first + run.numel()).copy_(run);  // runs never split an element
      lasts[e.name] += last;
    });
    for (size_t off = 0; off < bytes.size(); off += piece)
      r.feed(bytes.data() + off, std::min(piece, bytes.size() - off));
    r.finish();
    for (const auto& [name, x] : t) {
      EXPECT_EQ(lasts[name], 1) << name;
      EXPECT_TRUE(torch::equal(got[name], x.to(torch::kBFloat16).reshape({-1}))) << name << piece;
    }
  }
}

TEST(Framing, StreamReaderRejectsLiesAndTruncation) {
  const std::string good = safetensors_serialize({{"a", torch::ones({4})}});
  auto parse = [](const std::string& bytes, uint64_t total) {
    SafetensorsStreamReader r(total, "test", nullptr, nullptr);
    r.feed(bytes.data(), std::min<uint64_t>(bytes.size(), total));
    r.finish();
  };
  EXPECT_THAT(error_of([&] { parse(good, good.size() - 3); }), HasSubstr("outside the data"));
  EXPECT_THAT(error_of([&] {
    SafetensorsStreamReader r(good.size(), "test", nullptr, nullptr);
    r.feed(good.data(), good.size() - 3);
    r.finish();
  }), HasSubstr("ended after"));
  EXPECT_THAT(error_of([&] {
    SafetensorsStreamReader r(good.size(), "test", nullptr, nullptr);
    std::string longer = good + "xx";
    r.feed(longer.data(), longer.size());
  }), HasSubstr("longer than"));
  std::string huge = good;
  huge[5] = 0x7f;  // header length ~ 2^47
  EXPECT_THAT(error_of([&] { parse(huge, huge.size()); }), HasSubstr("exceeds"));
  // Overlapping tensors.
  const std::string h = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                        R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  std::string bad(8, '\0');
  bad[0] = static_cast<char>(h.size());
  bad += h + std::string(12, '\0');
  EXPECT_THAT(error_of([&] { parse(bad, bad.size()); }), HasSubstr("overlaps"));
}

TEST(Framing, WireRounding) {
  torch::Tensor x = torch::tensor({1.0f + 1.0f / 512, 3.14159f});
  wire_round_(x, WireDtype::F32);
  EXPECT_FLOAT_EQ(x[0].item<float>(), 1.0f + 1.0f / 512);
  wire_round_(x, WireDtype::BF16);
  EXPECT_TRUE(torch::equal(x, x.to(torch::kBFloat16).to(torch::kFloat32)));
  EXPECT_EQ(x[0].item<float>(), 1.0f);
}

// ---- round state ---------------------------------------------------------------------------
TEST(RoundState, JoinChecksFingerprintsAndSettings) {
  TempDir tmp;
  const Config cfg = tiny_config();
  RoundState st(cfg, {tmp.path, false});
  FakeNode good(cfg, 0, 1);
  // A different ownership map: nodes own experts {2,3} / {0,1}.
  FakeNode other_owner(tiny_config({"spes_config.expert_owners=[[1,1,0,0]]"}), 0, 1);
  EXPECT_THAT(error_of([&] { st.join(other_owner.join_info()); }),
              HasSubstr("expert ownership map differs"));
  FakeNode other_sync(tiny_config({"spes_config.sync_steps=5"}), 0, 1);
  EXPECT_THAT(error_of([&] { st.join(other_sync.join_info()); }), HasSubstr("sync_steps=5"));
  FakeNode other_model(tiny_config({"model.mlp_hidden_size=16"}), 0, 1);
  EXPECT_THAT(error_of([&] { st.join(other_model.join_info()); }),
              HasSubstr("model (tensor names, shapes, roles and dtypes) differs from the server's"));
  FakeNode other_topk(tiny_config({"model.moe_top_k=1"}), 0, 1);
  EXPECT_THAT(error_of([&] { st.join(other_topk.join_info()); }),
              HasSubstr("model section of its config differs"));
  // Not joined yet: no uploads.
  EXPECT_THAT(error_of([&] { send_upload(st, good.id, 1, good.upload(1)); }),
              HasSubstr("join first"));
  const JoinResult jr = st.join(good.join_info());
  EXPECT_EQ(jr.published_round, 0);
  EXPECT_EQ(jr.model_sha256, st.model().weights_sha256());
  // A node at another step (a restarted node) may join: the reply tells it what to take.
  JoinInfo late = good.join_info();
  late.step = 30;
  EXPECT_EQ(st.join(late).published_step, 0);
}

TEST(RoundState, RoundWithRejectedUploadsDownloadsAndKeptFiles) {
  TempDir tmp;
  const Config cfg = tiny_config({"spes_config.merge_interval=20", "spes_config.merge_topk=1",
                                  "spes_config.merge_alpha_start=0.1"});
  RoundState st(cfg, {tmp.path, /*keep_uploads=*/true});
  // Different seeds: the nodes start from different weights until they load round 0.
  FakeNode n0(cfg, 0, 11), n1(cfg, 1, 22);
  EXPECT_NE(n0.reg->weights_sha256(), n1.reg->weights_sha256());
  for (FakeNode* n : {&n0, &n1}) {
    st.join(n->join_info());
    n->download(st, 0, Selection::All);
    EXPECT_EQ(n->reg->weights_sha256(), st.model().weights_sha256());
  }
  const std::string round0 = st.model().weights_sha256();

  // Bytes per round per node (fp32): upload S + X/N, download P - own experts.
  const RoundPlan& plan = st.model().plan();
  int64_t S = 0, X = 0;
  for (const auto& t : plan.tensors()) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    (t.role == ParamRole::Expert ? X : S) += n;
  }
  EXPECT_EQ(plan.upload_data_bytes(0), static_cast<uint64_t>(4 * (S + X / 2)));
  EXPECT_EQ(n0.upload(1).data_bytes(), static_cast<uint64_t>(4 * (S + X / 2)));

  // "Train": change every trainable tensor on each node.
  {
    torch::NoGradGuard ng;
    for (const auto& e : n0.reg->entries()) if (e.trainable) e.tensor.add_(0.01);
    for (const auto& e : n1.reg->entries()) if (e.trainable) e.tensor.sub_(0.02);
  }
  // A corrupt chunk is refused with DataLoss; nothing reaches the model.
  try {
    send_upload(st, n1.id, 1, n1.upload(1), /*corrupt_chunk=*/1);
    FAIL() << "corrupt chunk accepted";
  } catch (const SyncError& e) {
    EXPECT_EQ(e.code(), SyncErrc::DataLoss);
    EXPECT_THAT(e.what(), HasSubstr("checksum mismatch"));
  }
  // (Uploads that fail the payload checks, which put a node out of its round, are in
  // reliability_round_test.cpp.)
  // A future round is refused (the node is not out of round 1 for it).
  EXPECT_THAT(error_of([&] { send_upload(st, n0.id, 2, n0.upload(2)); }),
              HasSubstr("the server collects round 1"));
  EXPECT_EQ(st.model().weights_sha256(), round0);  // nothing reached the model

  // Node 1 arrives first, node 0 second: folded in node order, published after both.
  EXPECT_TRUE(send_upload(st, n1.id, 1, n1.upload(1)).accepted);
  RoundStatus w1 = st.wait_round(n1.id, 1, 10);
  EXPECT_FALSE(w1.published);
  EXPECT_THAT(w1.waiting_for, ElementsAre(0));
  EXPECT_TRUE(send_upload(st, n0.id, 1, n0.upload(1)).accepted);
  EXPECT_TRUE(send_upload(st, n0.id, 1, n0.upload(1)).duplicate);  // a retry is ignored
  const RoundStatus w0 = st.wait_round(n0.id, 1, 10);
  ASSERT_TRUE(w0.published);
  EXPECT_EQ(w0.alpha, 0);  // step 10 is not a merge point (interval 20)
  EXPECT_EQ(w0.model_sha256, st.model().weights_sha256());
  // Each node gets P - its own experts (fp32) plus the stream header.
  {
    auto s = st.begin_download(n0.id, 1, Selection::ForNode);
    const uint64_t header = s->total_bytes() - static_cast<uint64_t>(4 * (S + X - X / 2));
    EXPECT_LT(header, 8192u);
  }
  uint64_t down0 = n0.download(st, 1, Selection::ForNode);
  uint64_t down1 = n1.download(st, 1, Selection::ForNode);
  EXPECT_EQ(down0, w0.download_bytes);
  EXPECT_EQ(down1, st.wait_round(n1.id, 1, 10).download_bytes);
  EXPECT_EQ(n0.reg->weights_sha256(), w0.model_sha256);
  EXPECT_EQ(n1.reg->weights_sha256(), w0.model_sha256);

  // Round 2 (step 20): a merge point; own experts come back too: the whole model.
  EXPECT_TRUE(send_upload(st, n0.id, 2, n0.upload(2)).accepted);
  EXPECT_TRUE(send_upload(st, n1.id, 2, n1.upload(2)).accepted);
  const RoundStatus w2 = st.wait_round(n0.id, 2, 10);
  ASSERT_TRUE(w2.published);
  EXPECT_GT(w2.alpha, 0);
  {
    auto s = st.begin_download(n0.id, 2, Selection::ForNode);
    const uint64_t header = s->total_bytes() - static_cast<uint64_t>(4 * (S + X));
    EXPECT_LT(header, 8192u);
  }
  n0.download(st, 2, Selection::ForNode);
  n1.download(st, 2, Selection::ForNode);
  EXPECT_EQ(n0.reg->weights_sha256(), w2.model_sha256);
  EXPECT_EQ(n1.reg->weights_sha256(), w2.model_sha256);

  // rounds.jsonl: one line per round once every node downloaded it.
  st.close();
  const auto lines = read_jsonl(tmp.path + "/rounds.jsonl");
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["round"], 1);
  EXPECT_EQ(lines[0]["step"], 10);
  EXPECT_THAT(lines[0]["nodes"].get<std::vector<int64_t>>(), ElementsAre(0, 1));
  EXPECT_EQ(lines[0]["alpha"].get<double>(), 0);
  EXPECT_GT(lines[1]["alpha"].get<double>(), 0);
  EXPECT_TRUE(lines[1]["merged"].get<bool>());
  EXPECT_EQ(lines[0]["bytes_out"].get<uint64_t>(), down0 + down1);
  EXPECT_EQ(lines[1]["bytes_in"].get<uint64_t>(),
            n0.upload(2).total_bytes() + n1.upload(2).total_bytes());
  EXPECT_EQ(lines[1]["model_sha256"], w2.model_sha256);
  EXPECT_EQ(lines[0]["gate_cos"].size(), 1u);
  EXPECT_TRUE(lines[0]["downloads_complete"].get<bool>());
  for (const auto& l : lines) {
    // The server's part after the last upload holds the persisting, and fits in the round's
    // time from its first upload (`seconds` stops before the persisting).
    const double publish_s = l["publish_s"].get<double>(), persist_s = l["persist_s"].get<double>();
    EXPECT_GT(persist_s, 0);
    EXPECT_GE(publish_s, persist_s);
    EXPECT_LE(publish_s, l["seconds"].get<double>() + persist_s + 0.05);
  }
  // Kept uploads re-aggregate, with `spes aggregate`'s code, to the published bytes.
  for (int r : {1, 2})
    for (const char* f : {"node0.safetensors", "node1.safetensors", "published.safetensors"})
      EXPECT_TRUE(fs::exists(tmp.path + "/rounds/" + std::to_string(r) + "/" + f)) << r << f;
  const auto v = verify_kept_rounds(cfg, tmp.path);
  EXPECT_EQ(v["checked"], 2);
  EXPECT_EQ(v["equal"], 2);
  // And a round is refused once superseded (download of an old round).
  EXPECT_THAT(error_of([&] { st.begin_download(n0.id, 1, Selection::ForNode); }),
              HasSubstr("no longer available"));
}
