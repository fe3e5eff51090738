// Compressed downloads against the server's round logic, driven directly on RoundState: with
// int8 (and bf16) compression the published model is P_prev + deq(D), a node holding the
// previous round rebuilds it bit for bit from the delta stream (checked against an
// independent reconstruction from the delta file with torch ops), an owner is not sent its own
// expert, a node that missed a round (or asks without a base) gets full tensors with the same
// digest, a restarted server serves the delta it persisted (and full tensors without it), and a
// corrupted delta is refused before it is applied or, when it parses, fails the digest check,
// after which a full download restores the published model; and the delta file, written while
// the round is computed, is never served or resumed as another round's when the round's save
// fails or the server dies before it, and a delta file that cannot be written costs the round
// its delta only.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <limits>
#include <thread>

#include "spes/io/files.h"
#include "spes/io/run_layout.h"
#include "spes/sync/node/download.h"
#include "spes/sync/round/delta_upload.h"
#include "spes/sync/round/published_delta.h"
#include "spes/sync/server/round_state.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
namespace fs = std::filesystem;

namespace {

const std::string kOwnExpert = "model.layers.0.mlp.experts.0.gate_proj.weight";  // node 0's

// Trains every trainable tensor a little (different on each node and round).
void train(FakeNode& n, uint64_t seed) {
  torch::NoGradGuard ng;
  torch::manual_seed(seed);
  for (const auto& e : n.reg->entries())
    if (e.trainable) e.tensor.add_(torch::randn(e.tensor.sizes()) * 0.01);
}

// The bytes of a download stream.
std::string stream_bytes(RoundState& st, const NodeId& id, int64_t round, Selection sel,
                         int64_t from_round) {
  auto s = st.begin_download(id, round, sel, 0, from_round);
  std::string all, data;
  uint64_t off = 0;
  while (s->next(&data, &off)) all += data;
  return all;
}

// Feeds `bytes` into a receiver in 700-byte pieces.
void receive(DownloadReceiver& r, const std::string& bytes) {
  r.begin(bytes.size());
  for (size_t off = 0; off < bytes.size(); off += 700)
    r.feed(bytes.data() + off, std::min<size_t>(700, bytes.size() - off));
  ASSERT_TRUE(r.done());
}

struct Node {
  FakeNode fake;
  DeltaUpload delta;
  Node(const Config& cfg, int64_t id, Compression c) : fake(cfg, id, 11 * (id + 1)), delta(c) {}
};

// Nodes 0 and 1 with int8 compression.
std::vector<std::unique_ptr<Node>> int8_nodes(const Config& cfg) {
  std::vector<std::unique_ptr<Node>> nodes;
  for (int64_t i = 0; i < 2; ++i)
    nodes.push_back(std::make_unique<Node>(cfg, i, Compression::Int8));
  return nodes;
}

// Two nodes joined at round 0 (both hold the initial model).
void join_all(RoundState& st, std::vector<std::unique_ptr<Node>>& nodes) {
  for (auto& n : nodes) {
    st.join(n->fake.join_info());
    n->fake.download(st, 0, Selection::All);
    n->delta.set_base(*n->fake.reg, true);
  }
}

// Every node trains and uploads round r; the round publishes.
void run_round(RoundState& st, std::vector<std::unique_ptr<Node>>& nodes, int64_t r,
               Compression c) {
  for (auto& n : nodes) {
    train(n->fake, 100 * r + n->fake.id.node_id);
    UploadMeta m{n->fake.id.node_id, r, r * 10, 80, n->fake.id.incarnation,
                 n->fake.reg->fingerprint()};
    m.compression = c;
    ASSERT_TRUE(send_upload(st, n->fake.id, r, n->delta.encode(*n->fake.reg, m)).accepted);
  }
  ASSERT_EQ(st.published_round(), r);
}

// A node whose upload round r used takes its rebuilt upload and receives `bytes`.
void take_round(Node& n, int64_t r, const std::string& bytes, int64_t from_round,
                DownloadReceiver* out = nullptr) {
  n.delta.apply_rebuilt(*n.fake.reg);
  DownloadReceiver local(*n.fake.reg, r, Selection::ForNode, WireDtype::F32, &n.delta,
                         from_round);
  DownloadReceiver& rec = out ? *out : local;
  receive(rec, bytes);
}

}  // namespace

TEST(DeltaDownload, NodesRebuildThePublishedDigestFromTheDelta) {
  for (const char* comp : {"int8", "bf16"}) {
    TempDir dir;
    const Config cfg = tiny_config({std::string("spes_config.compression=") + comp});
    const Compression c = Choice<Compression>::parse(comp);
    RoundState st(cfg, ServeOptions{dir.path, /*keep_uploads=*/true});
    std::vector<std::unique_ptr<Node>> nodes;
    for (int64_t i = 0; i < 2; ++i) nodes.push_back(std::make_unique<Node>(cfg, i, c));
    join_all(st, nodes);
    const RoundPlan& plan = st.model().plan();
    for (int64_t r = 1; r <= 3; ++r) {
      // The previous published model, from its kept file.
      const NamedTensors prev = safetensors_load(
          dir.path + "/rounds/" + std::to_string(r - 1) + "/published.safetensors");
      run_round(st, nodes, r, c);
      const std::string sha = st.status().model_sha256;
      // Independent reconstruction: published = prev + q * scale (torch, fp32 ops) for every
      // tensor of the delta file, and prev elsewhere.
      const NamedTensors delta = safetensors_load(run_layout::published_delta(dir.path));
      auto find = [](const NamedTensors& t, const std::string& name) {
        for (const auto& [n, v] : t)
          if (n == name) return v;
        return torch::Tensor();
      };
      for (size_t i = 0; i < plan.tensors().size(); ++i) {
        const std::string& name = plan.tensors()[i].name;
        const torch::Tensor p = find(prev, name);
        const torch::Tensor q = find(delta, name);
        ASSERT_TRUE(p.defined()) << name;
        torch::Tensor want = p;
        if (q.defined()) {
          torch::Tensor dq;
          if (c == Compression::Int8) {
            const torch::Tensor s = find(delta, delta_scale_name(name));
            ASSERT_TRUE(s.defined()) << name;
            const torch::Tensor per = s.repeat_interleave(kDeltaBlock).slice(0, 0, q.numel());
            dq = q.to(torch::kFloat32).view({-1}).mul(per).view(q.sizes());
            // Q's own property: every non-zero block reaches +-127.
            const torch::Tensor qa = q.to(torch::kInt32).abs().view({-1});
            for (int64_t b = 0; b < s.numel(); ++b)
              if (s[b].item<float>() > 0)
                EXPECT_EQ(qa.slice(0, b * kDeltaBlock, std::min<int64_t>(qa.numel(),
                                                                         (b + 1) * kDeltaBlock))
                              .max()
                              .item<int>(),
                          127)
                    << name << " block " << b;
          } else {
            dq = q.to(torch::kFloat32);
          }
          want = p.add(dq);
        }
        EXPECT_TRUE(torch::equal(st.model().tensors()[i], want)) << comp << " " << name;
      }
      for (auto& n : nodes) {
        DownloadReceiver rec(*n->fake.reg, r, Selection::ForNode, WireDtype::F32, &n->delta,
                             r - 1);
        take_round(*n, r, stream_bytes(st, n->fake.id, r, Selection::ForNode, r - 1), r - 1,
                   &rec);
        EXPECT_TRUE(rec.is_delta()) << comp;
        EXPECT_EQ(n->fake.reg->weights_sha256(), sha) << comp << " node " << n->fake.id.node_id;
        // The owner is not sent its own expert (published as its rebuilt upload); others are.
        EXPECT_EQ(rec.names().count(kOwnExpert), n->fake.id.node_id == 0 ? 0u : 1u)
            << comp << " node " << n->fake.id.node_id;
        n->delta.set_base(*n->fake.reg, false);
      }
      // The delta's values take about the codec's share of the whole model's (the headers of
      // this tiny model are not compared).
      auto data_bytes = [](const std::string& b) {
        uint64_t n = 0;
        std::memcpy(&n, b.data(), 8);
        return static_cast<double>(b.size() - 8 - n);
      };
      const double full =
          data_bytes(stream_bytes(st, nodes[1]->fake.id, r, Selection::All, -1));
      const double d =
          data_bytes(stream_bytes(st, nodes[1]->fake.id, r, Selection::ForNode, r - 1));
      EXPECT_LT(d, full * (c == Compression::Int8 ? 0.4 : 0.55)) << comp;
    }
  }
}

TEST(DeltaDownload, ANodeThatMissedARoundGetsFullTensorsAndTheSameDigest) {
  TempDir dir;
  const Config cfg = tiny_config({"spes_config.compression=int8"});
  RoundState st(cfg, ServeOptions{dir.path});
  std::vector<std::unique_ptr<Node>> nodes = int8_nodes(cfg);
  join_all(st, nodes);
  run_round(st, nodes, 1, Compression::Int8);
  run_round(st, nodes, 2, Compression::Int8);
  const std::string sha = st.status().model_sha256;
  // Node 1 says it holds round 0 (it missed round 1), node 0 names no base: full tensors.
  for (int64_t from : {int64_t{0}, int64_t{-1}}) {
    Node& n = *nodes[from == 0 ? 1 : 0];
    DownloadReceiver rec(*n.fake.reg, 2, Selection::ForNode, WireDtype::F32, &n.delta, from);
    const std::string bytes = stream_bytes(st, n.fake.id, 2, Selection::ForNode, from);
    receive(rec, bytes);
    EXPECT_FALSE(rec.is_delta()) << from;
    EXPECT_EQ(rec.names().size(), n.fake.reg->entries().size()) << from;
    EXPECT_EQ(n.fake.reg->weights_sha256(), sha) << from;
  }
}

TEST(DeltaDownload, ARestartedServerServesTheDeltaItPersistedAndFullTensorsWithoutIt) {
  TempDir dir;
  const Config cfg = tiny_config({"spes_config.compression=int8"});
  std::vector<std::unique_ptr<Node>> nodes = int8_nodes(cfg);
  std::string sha;
  {
    RoundState st(cfg, ServeOptions{dir.path});
    join_all(st, nodes);
    run_round(st, nodes, 1, Compression::Int8);
    sha = st.status().model_sha256;
  }
  for (bool keep_delta : {true, false}) {
    if (!keep_delta) std::filesystem::remove(run_layout::published_delta(dir.path));
    RoundState st(cfg, ServeOptions{dir.path});  // resumes round 1
    ASSERT_EQ(st.published_round(), 1);
    st.join(nodes[1]->fake.join_info());
    const std::string bytes = stream_bytes(st, nodes[1]->fake.id, 1, Selection::ForNode, 0);
    const StreamHeader h = [&] {
      const std::string path = dir.path + "/stream.safetensors";
      file_write_atomic(path, bytes);
      return read_stream_header(path);
    }();
    EXPECT_EQ(h.metadata.at("format"),
              keep_delta ? "spes-download-delta-v1" : "spes-download-v1");
    if (keep_delta) {
      // Node 1 still holds round 0 (base) and its upload: the persisted delta rebuilds round 1.
      Node& n = *nodes[1];
      DownloadReceiver rec(*n.fake.reg, 1, Selection::ForNode, WireDtype::F32, &n.delta, 0);
      take_round(n, 1, bytes, 0, &rec);
      EXPECT_TRUE(rec.is_delta());
      EXPECT_EQ(n.fake.reg->weights_sha256(), sha);
    } else {
      EXPECT_EQ(h.entries.size(), nodes[1]->fake.reg->entries().size());
    }
  }
}

TEST(DeltaDownload, ACorruptedDeltaIsRefusedAndTheNodeRecoversWithAFullDownload) {
  TempDir dir;
  const Config cfg = tiny_config({"spes_config.compression=int8"});
  RoundState st(cfg, ServeOptions{dir.path});
  std::vector<std::unique_ptr<Node>> nodes = int8_nodes(cfg);
  join_all(st, nodes);
  run_round(st, nodes, 1, Compression::Int8);
  const std::string sha = st.status().model_sha256;
  Node& n = *nodes[1];
  const std::string good = stream_bytes(st, n.fake.id, 1, Selection::ForNode, 0);
  const StreamHeader h = [&] {
    const std::string path = dir.path + "/stream.safetensors";
    file_write_atomic(path, good);
    return read_stream_header(path);
  }();
  auto at = [&](const std::string& name) -> uint64_t {
    for (const auto& e : h.entries)
      if (e.name == name) return h.header_bytes + e.begin;
    ADD_FAILURE() << "no entry " << name;
    return 0;
  };
  const std::string norm = "model.layers.0.input_layernorm.weight";
  auto refused = [&](const std::string& bytes, int64_t from_round) {
    DownloadReceiver rec(*n.fake.reg, 1, Selection::ForNode, WireDtype::F32, &n.delta,
                         from_round);
    return error_of([&] {
      rec.begin(bytes.size());
      rec.feed(bytes.data(), bytes.size());
    });
  };
  // A NaN scale, a scale above the bound: refused when the run arrives, before any use.
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), 1e38f}) {
    std::string b = good;
    std::memcpy(&b[at(delta_scale_name(norm))], &bad, 4);
    // The node's error names its download, not an upload.
    EXPECT_THAT(refused(b, 0), AllOf(HasSubstr("download of round 1"),
                                     HasSubstr("is not a finite value"),
                                     Not(HasSubstr("upload")))) << bad;
  }
  // A delta the node did not ask for (it names no base round), or from another round.
  EXPECT_THAT(refused(good, -1), HasSubstr("did not ask for"));
  EXPECT_THAT(refused(good, 5), HasSubstr("from round 5"));
  {  // A delta stream received without compression on the node.
    DeltaUpload none(Compression::None);
    DownloadReceiver rec(*n.fake.reg, 1, Selection::ForNode, WireDtype::F32, &none, 0);
    EXPECT_THAT(error_of([&] {
                  rec.begin(good.size());
                  rec.feed(good.data(), good.size());
                }),
                HasSubstr("did not ask for"));
  }
  // A flipped value byte parses: applied, the digest differs, a full download restores it.
  std::string flipped = good;
  flipped[at(norm)] ^= 0x01;
  take_round(n, 1, flipped, 0);
  EXPECT_NE(n.fake.reg->weights_sha256(), sha);
  DownloadReceiver full(*n.fake.reg, 1, Selection::All, WireDtype::F32);
  receive(full, stream_bytes(st, n.fake.id, 1, Selection::All, -1));
  EXPECT_FALSE(full.is_delta());
  EXPECT_EQ(n.fake.reg->weights_sha256(), sha);
}

namespace {

// Large enough that the published model outweighs the delta file, and the delta file well
// outweighs each upload (mostly experts: a node uploads half of them; the tiny model's headers
// would otherwise dominate).
Config larger_int8_config() {
  return tiny_config({"spes_config.compression=int8", "model.d_model=32",
                      "model.vocab_size=64", "model.mlp_hidden_size=64"});
}

// The format named in a stream's header (parsed in memory: no file, whatever the disk allows).
std::string stream_format(const std::string& bytes) {
  const uint64_t n = safetensors_header_length(bytes.data());
  return safetensors_header_decode(bytes.data() + 8, n, bytes.size() - 8 - n, "stream")
      .metadata.at("format");
}

// A node that holds nothing yet receives `bytes` (a whole-model stream) of round r.
std::string digest_from_full_stream(const Config& cfg, int64_t r, const std::string& bytes) {
  FakeNode probe(cfg, 1, 5);
  DownloadReceiver rec(*probe.reg, r, Selection::ForNode, WireDtype::F32);
  receive(rec, bytes);
  EXPECT_FALSE(rec.is_delta());
  return probe.reg->weights_sha256();
}

// Every node trains and uploads round r; the round need not publish.
void upload_round(RoundState& st, std::vector<std::unique_ptr<Node>>& nodes, int64_t r) {
  for (auto& n : nodes) {
    train(n->fake, 100 * r + n->fake.id.node_id);
    UploadMeta m{n->fake.id.node_id, r, r * 10, 80, n->fake.id.incarnation,
                 n->fake.reg->fingerprint()};
    m.compression = Compression::Int8;
    ASSERT_TRUE(send_upload(st, n->fake.id, r, n->delta.encode(*n->fake.reg, m)).accepted);
  }
}

// Every node takes the delta of round r (from r - 1) and checks the published digest.
void take_delta_round(RoundState& st, std::vector<std::unique_ptr<Node>>& nodes, int64_t r) {
  const std::string sha = st.status().model_sha256;
  for (auto& n : nodes) {
    DownloadReceiver rec(*n->fake.reg, r, Selection::ForNode, WireDtype::F32, &n->delta, r - 1);
    take_round(*n, r, stream_bytes(st, n->fake.id, r, Selection::ForNode, r - 1), r - 1, &rec);
    EXPECT_TRUE(rec.is_delta()) << "node " << n->fake.id.node_id;
    EXPECT_EQ(n->fake.reg->weights_sha256(), sha) << "node " << n->fake.id.node_id;
    n->delta.set_base(*n->fake.reg, false);
  }
}

}  // namespace

// The delta file of round 2 is written while round 2 is computed, before its model is saved:
// when that save fails (a full disk) round 1 stays the published round, and its downloads
// must not be served from the file that now holds round 2's delta. The server then dies; the
// restarted one resumes round 1 (serving it whole: the file holds round 2's delta), and round 2,
// uploaded again, publishes a delta that every node applies to the published digest.
TEST(DeltaDownload, ASaveThatFailsAfterTheDeltaFileNeitherServesNorResumesTheWrongDelta) {
  TempDir dir;
  const Config cfg = larger_int8_config();
  std::vector<std::unique_ptr<Node>> nodes = int8_nodes(cfg);
  std::string sha1;
  {
    RoundState st(cfg, ServeOptions{dir.path});
    join_all(st, nodes);
    run_round(st, nodes, 1, Compression::Int8);
    sha1 = st.status().model_sha256;
    const std::string before = stream_bytes(st, nodes[1]->fake.id, 1, Selection::ForNode, 0);
    EXPECT_EQ(stream_format(before), "spes-download-delta-v1");
    take_delta_round(st, nodes, 1);
    // Round 2's delta file (the same layout as round 1's: the same size) fits; its model does
    // not.
    const uint64_t delta_size = fs::file_size(run_layout::published_delta(dir.path));
    ASSERT_LT(delta_size, fs::file_size(dir.path + "/published.safetensors"));
    {
      FileSizeLimit full(delta_size);
      upload_round(st, nodes, 2);
      ASSERT_EQ(st.published_round(), 1);
      EXPECT_THAT(st.status().publish_error, HasSubstr("disk full"));
      const StreamHeader h = read_stream_header(run_layout::published_delta(dir.path));
      ASSERT_EQ(h.metadata.at("round"), "2");  // the next round's delta is in place
      const std::string again = stream_bytes(st, nodes[1]->fake.id, 1, Selection::ForNode, 0);
      if (again != before) {  // not round 1's delta: then the whole round-1 model
        EXPECT_EQ(stream_format(again), "spes-download-v1");
        EXPECT_EQ(digest_from_full_stream(cfg, 1, again), sha1);
      }
    }
  }  // the server dies with round 2 closed and unsaved
  RoundState st(cfg, ServeOptions{dir.path});
  ASSERT_EQ(st.published_round(), 1);
  EXPECT_EQ(st.status().model_sha256, sha1);
  for (auto& n : nodes) st.join(n->fake.join_info());
  const std::string full = stream_bytes(st, nodes[1]->fake.id, 1, Selection::ForNode, 0);
  EXPECT_EQ(stream_format(full), "spes-download-v1");
  EXPECT_EQ(digest_from_full_stream(cfg, 1, full), sha1);
  upload_round(st, nodes, 2);
  ASSERT_EQ(st.published_round(), 2);
  take_delta_round(st, nodes, 2);
}

// A delta file that cannot be written costs the round its delta, never the round: once the
// model can be saved the round publishes, and nodes get it whole, at the published digest.
TEST(DeltaDownload, ARoundWhoseDeltaFileCannotBeWrittenPublishesWhole) {
  TempDir dir;
  const Config cfg = larger_int8_config();
  std::vector<std::unique_ptr<Node>> nodes = int8_nodes(cfg);
  RoundState st(cfg, ServeOptions{dir.path, /*keep_uploads=*/true});
  join_all(st, nodes);
  run_round(st, nodes, 1, Compression::Int8);
  take_delta_round(st, nodes, 1);
  const uint64_t delta_size = fs::file_size(run_layout::published_delta(dir.path));
  const uint64_t upload_size = std::max(fs::file_size(dir.path + "/rounds/1/node0.safetensors"),
                                        fs::file_size(dir.path + "/rounds/1/node1.safetensors"));
  ASSERT_LT(upload_size, delta_size);
  {
    // Room for the uploads (staged on disk; round 2's are as large), not for the delta file
    // nor the model.
    FileSizeLimit full((upload_size + delta_size) / 2);
    upload_round(st, nodes, 2);
    ASSERT_EQ(st.published_round(), 1);
    EXPECT_THAT(st.status().publish_error, HasSubstr("disk full"));
    EXPECT_FALSE(fs::exists(dir.path + "/delta.safetensors.tmp." + std::to_string(::getpid())));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(5200));  // the save's retry interval
  st.tick();
  ASSERT_EQ(st.published_round(), 2);
  const std::string sha = st.status().model_sha256;
  for (auto& n : nodes) {
    n->delta.apply_rebuilt(*n->fake.reg);
    DownloadReceiver rec(*n->fake.reg, 2, Selection::ForNode, WireDtype::F32, &n->delta, 1);
    receive(rec, stream_bytes(st, n->fake.id, 2, Selection::ForNode, 1));
    EXPECT_FALSE(rec.is_delta());
    EXPECT_EQ(n->fake.reg->weights_sha256(), sha);
  }
}
