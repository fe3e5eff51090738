// Compressed uploads against the server's round logic, driven directly on RoundState: nodes
// upload int8 (and bf16) deltas with DeltaUpload, the server rebuilds them against its
// published model, and each node, after taking its own upload as rebuilt and downloading the
// rest, holds exactly the published digest; `spes aggregate` on the kept compressed uploads
// reproduces the published model. Hostile compressed uploads (bad scales, wrong block count,
// wrong dtypes, a missing compression tag) are refused with their reason and leave the
// published model unchanged; the per-tensor update bound applies to the rebuilt values.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <map>

#include "spes/sync/round/delta_upload.h"
#include "spes/sync/round/aggregate.h"
#include "spes/sync/server/round_state.h"
#include "spes/sync/wire/delta_codec.h"
#include "sync/compressed_upload_parts.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;
using ::testing::HasSubstr;

namespace {

const std::string kNorm = "model.layers.0.input_layernorm.weight";  // 8 values

UploadMeta meta_of(const FakeNode& n, int64_t round, Compression c) {
  UploadMeta m{n.id.node_id, round, round * 10, 80, n.id.incarnation, n.reg->fingerprint()};
  m.compression = c;
  return m;
}

// A node's int8 upload of `delta` (per trainable tensor; missing names: 0), hand-built so
// that a test can break any part of it.
NamedTensors int8_parts(const FakeNode& n, const std::map<std::string, torch::Tensor>& delta) {
  return compressed_upload_parts(n, Compression::Int8, [&](const RegistryEntry& e) {
    auto it = delta.find(e.name);
    return it != delta.end() ? it->second : torch::zeros_like(e.tensor);
  });
}

torch::Tensor& part(NamedTensors& t, const std::string& name) {
  for (auto& [n, v] : t)
    if (n == name) return v;
  throw std::runtime_error("no part " + name);
}

// Trains every trainable tensor a little (different on each node).
void train(FakeNode& n, double seed) {
  torch::NoGradGuard ng;
  torch::manual_seed(static_cast<uint64_t>(seed));
  for (const auto& e : n.reg->entries())
    if (e.trainable) e.tensor.add_(torch::randn(e.tensor.sizes()) * 0.01);
}

}  // namespace

TEST(CompressedRound, NodesHoldThePublishedDigestAndAggregateReproducesIt) {
  for (const char* comp : {"int8", "bf16"}) {
    TempDir dir;
    const Config cfg = tiny_config({std::string("spes_config.compression=") + comp});
    const Compression c = Choice<Compression>::parse(comp);
    RoundState st(cfg, ServeOptions{dir.path, /*keep_uploads=*/true});
    FakeNode n0(cfg, 0, 11), n1(cfg, 1, 22);
    DeltaUpload d0(c), d1(c);
    for (auto [n, d] : {std::pair{&n0, &d0}, std::pair{&n1, &d1}}) {
      st.join(n->join_info());
      n->download(st, 0, Selection::All);
      d->set_base(*n->reg, true);
    }
    const RoundPlan& plan = st.model().plan();
    EXPECT_EQ(plan.upload_data_bytes(0), d0.upload_data_bytes(*n0.reg));
    for (int64_t r = 1; r <= 3; ++r) {
      NamedTensors before;  // copies: named() gives views of the live model
      for (const auto& [name, t] : st.model().named()) before.emplace_back(name, t.clone());
      for (auto [n, d] : {std::pair{&n0, &d0}, std::pair{&n1, &d1}}) {
        train(*n, 100 * r + n->id.node_id);
        const SafetensorsStreamWriter w = d->encode(*n->reg, meta_of(*n, r, c));
        EXPECT_EQ(w.data_bytes(), plan.upload_data_bytes(n->id.node_id));
        EXPECT_TRUE(send_upload(st, n->id, r, w).accepted) << comp << " round " << r;
      }
      ASSERT_EQ(st.published_round(), r) << comp;
      const std::string sha = st.status().model_sha256;
      for (auto [n, d] : {std::pair{&n0, &d0}, std::pair{&n1, &d1}}) {
        d->apply_rebuilt(*n->reg);
        n->download(st, r, Selection::ForNode);
        EXPECT_EQ(n->reg->weights_sha256(), sha) << comp << " node " << n->id.node_id;
        d->set_base(*n->reg, false);
      }
      // The published owner copy of node 0's expert is its rebuilt upload, bit for bit.
      const std::string expert = "model.layers.0.mlp.experts.0.gate_proj.weight";
      const int64_t i = plan.index(expert);
      ASSERT_GE(i, 0);
      EXPECT_TRUE(torch::equal(st.model().tensors()[i], n0.reg->find(expert)->tensor));
      // `spes aggregate` on the kept compressed uploads gives the published model exactly.
      SyncModel offline(cfg);
      offline.load(before, "previous");
      aggregate_offline(offline,
                        {dir.path + "/rounds/" + std::to_string(r) + "/node1.safetensors",
                         dir.path + "/rounds/" + std::to_string(r) + "/node0.safetensors"},
                        10 * r);
      EXPECT_EQ(offline.weights_sha256(), sha) << comp << " round " << r;
    }
  }
}

TEST(CompressedRound, HostileCompressedUploadsAreRefusedAndChangeNothing) {
  const Config cfg = tiny_config({"spes_config.compression=int8"});
  const float inf = std::numeric_limits<float>::infinity();
  struct Case {
    const char* what;
    std::function<void(NamedTensors&, UploadMeta&)> spoil;
    const char* reason;
  };
  const std::string norm_scale = delta_scale_name(kNorm);
  const std::vector<Case> cases = {
      {"Inf scale", [&](NamedTensors& t, UploadMeta&) { part(t, norm_scale)[0] = inf; },
       "int8 scale inf"},
      {"NaN scale",
       [&](NamedTensors& t, UploadMeta&) {
         part(t, norm_scale)[0] = std::numeric_limits<float>::quiet_NaN();
       },
       "int8 scale nan"},
      {"negative scale", [&](NamedTensors& t, UploadMeta&) { part(t, norm_scale)[0] = -1.0f; },
       "int8 scale -1"},
      {"huge scale", [&](NamedTensors& t, UploadMeta&) { part(t, norm_scale)[0] = 1e38f; },
       "is not a finite value"},
      {"wrong block count",
       [&](NamedTensors& t, UploadMeta&) { part(t, norm_scale) = torch::zeros({2}); },
       "(F32, [1])"},
      {"I8 where F32 expected",
       [&](NamedTensors& t, UploadMeta&) {
         part(t, norm_scale) = part(t, norm_scale).to(torch::kInt8);
       },
       "(I8, [1])"},
      {"F32 values instead of I8",
       [&](NamedTensors& t, UploadMeta&) { part(t, kNorm) = part(t, kNorm).to(torch::kFloat32); },
       "is F32 but compression is int8 (expected I8)"},
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
    torch::Tensor d = torch::full({8}, 0.01f);
    NamedTensors t = int8_parts(a, {{kNorm, d}});
    UploadMeta m = meta_of(a, 1, Compression::Int8);
    k.spoil(t, m);
    const SafetensorsStreamWriter w = SafetensorsStreamWriter::as_stored(t, upload_metadata(m));
    SyncErrc code = SyncErrc::Internal;
    const std::string why = error_of([&] {
      try {
        send_upload(st, a.id, 1, w);
      } catch (const SyncError& e) {
        code = e.code();
        throw;
      }
    });
    EXPECT_EQ(code, SyncErrc::InvalidArgument) << k.what << ": " << why;
    EXPECT_THAT(why, HasSubstr(k.reason)) << k.what;
    if (std::string(k.what) != "no compression tag") {
      EXPECT_THAT(why, HasSubstr(kNorm)) << k.what;
    }
    EXPECT_EQ(st.status().model_sha256, sha) << k.what;
    EXPECT_EQ(st.model().weights_sha256(), sha) << k.what;
    // The honest node's upload publishes the round without the hostile one.
    EXPECT_TRUE(send_upload(st, b.id, 1, SafetensorsStreamWriter::as_stored(
                                             int8_parts(b, {}), upload_metadata(meta_of(
                                                                    b, 1, Compression::Int8))))
                    .accepted);
    EXPECT_EQ(st.published_round(), 1) << k.what;
    EXPECT_EQ(st.round_history().back()["nodes"], nlohmann::json::array({1})) << k.what;
    EXPECT_EQ(st.model().weights_sha256(), sha) << k.what << ": zero deltas change nothing";
  }
}

TEST(CompressedRound, UpdateBoundAppliesToTheRebuiltValues) {
  TempDir dir;
  const Config cfg = tiny_config({"spes_config.compression=int8", "spes_config.outlier_factor=0"});
  RoundState st(cfg, ServeOptions{dir.path});
  FakeNode a(cfg, 0, 1);
  st.join(a.join_info());
  const torch::Tensor pub = st.model().tensors()[st.model().plan().index(kNorm)];
  // Small int8 codes with a scale that makes the rebuilt tensor 12x the published one.
  NamedTensors t = int8_parts(a, {{kNorm, pub * 11.0}});
  const std::string why = error_of([&] {
    send_upload(st, a.id, 1, SafetensorsStreamWriter::as_stored(
                                 t, upload_metadata(meta_of(a, 1, Compression::Int8))));
  });
  EXPECT_THAT(why, HasSubstr("max_tensor_update_ratio"));
  EXPECT_THAT(why, HasSubstr(kNorm));
  EXPECT_EQ(st.published_round(), 0);
}

TEST(CompressedRound, ConfigAndJoinRefuseMismatches) {
  EXPECT_THAT(error_of([] { tiny_config({"spes_config.compression=fp8"}); }),
              HasSubstr("spes_config.compression must be none, bf16, int8 or topk"));
  const std::string why = error_of([] {
    tiny_config({"spes_config.compression=int8", "spes_config.transfer_dtype=bf16"});
  });
  EXPECT_THAT(why, HasSubstr("spes_config.compression"));
  EXPECT_THAT(why, HasSubstr("transfer_dtype"));
  TempDir dir;
  RoundState st(tiny_config({"spes_config.compression=int8"}), ServeOptions{dir.path});
  FakeNode plain(tiny_config(), 0, 1);
  const std::string join = error_of([&] { st.join(plain.join_info()); });
  EXPECT_THAT(join, HasSubstr("spes_config.compression=none on the node, int8 on the server"));
}
