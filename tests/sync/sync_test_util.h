// Helpers shared by the sync tests: a self-deleting temporary directory, a tiny MoE config,
// hand-made uploads, a node as the server sees it (FakeNode, trained, upload_of, send_upload) to
// drive RoundState, a file size limit that makes writes fail as a full disk does, and what a
// call fails with (error_of, code_of).
#pragma once
#include <torch/torch.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>

#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "spes/io/config.h"
#include "spes/model/ownership.h"
#include "spes/model/registry.h"
#include "spes/model/transformer.h"
#include "spes/sync/round/aggregate.h"
#include "spes/sync/round/plan.h"
#include "spes/sync/server/round_state.h"
#include "spes/sync/wire/checksum.h"
#include "spes/sync/wire/framing.h"
#include "spes/sync/wire/protocol.h"

namespace spes::sync::testing {

// A temporary directory (path as a string, as the sync code takes it), removed at scope end.
struct TempDir {
  std::string path;
  TempDir() {
    path = (std::filesystem::temp_directory_path() /
            ("spes_sync_test_" + std::to_string(::getpid()) + "_" +
             std::to_string(std::random_device{}())))
               .string();
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

// 1 layer (or `layers`), 4 experts, d_model 8, F 4, vocab 16; mode spes over 2 nodes (node 0
// owns experts 0-1, node 1 owns 2-3), sync every 10 steps, merging off unless set.
inline Config tiny_config(std::vector<std::string> sets = {}, int layers = 1) {
  const std::string yaml =
      "model:\n  d_model: 8\n  n_layers: " + std::to_string(layers) +
      "\n  n_heads: 2\n  mlp_hidden_size: 8\n"
      "  moe_num_experts: 4\n  moe_top_k: 2\n  vocab_size: 16\n  max_sequence_length: 8\n"
      "spes_config:\n  mode: spes\n  num_peers: 2\n  sync_steps: 10\n  merge_interval: 0\n";
  return config_parse(yaml, sets, "tiny.yaml");
}

// Folds an upload for `node` whose tensors are filled by value(plan tensor).
template <class F>
void fold_filled(RoundAggregator& agg, const RoundPlan& plan, int64_t node, int64_t tokens,
                 F value) {
  agg.begin_node(node, tokens);
  for (size_t i : plan.upload_of(node)) {
    const PlanTensor& t = plan.tensors()[i];
    agg.add(t.name, value(t));
  }
  agg.end_node();
}

inline torch::Tensor full(const PlanTensor& t, double v) {
  return torch::full(t.shape, v, torch::kFloat32);
}

// Value of every element of a published tensor, checked to be uniform.
inline double uniform_value(const SyncModel& m, const std::string& name) {
  const torch::Tensor& t = m.tensors().at(m.plan().index(name));
  const double lo = t.min().item<double>(), hi = t.max().item<double>();
  if (lo != hi) return std::nan("");
  return lo;
}

// A node as the server sees it: a model with its own seed, its registry and identity.
struct FakeNode {
  Config cfg;
  std::unique_ptr<Transformer> model;
  std::unique_ptr<ParamRegistry> reg;
  NodeId id;
  FakeNode(const Config& c, int64_t node, uint64_t seed) : cfg(c) {
    model = std::make_unique<Transformer>(cfg.model);
    model->init_weights(seed);
    reg = std::make_unique<ParamRegistry>(*model, cfg, Ownership::from_config(cfg), node);
    id = NodeId{node, 1000 + static_cast<uint64_t>(node), ""};
  }
  JoinInfo join_info() const { return node_join_info(cfg, *reg, id, 0); }
  SafetensorsStreamWriter upload(int64_t round, int64_t tokens = 80) const {
    return node_upload_writer(*reg, UploadMeta{id.node_id, round, round * 10, tokens,
                                               id.incarnation, reg->fingerprint()},
                              WireDtype::F32);
  }
  // Receives a download stream into the registry.
  uint64_t download(RoundState& st, int64_t round, Selection sel) {
    auto s = st.begin_download(id, round, sel);
    SafetensorsStreamReader r(s->total_bytes(), "download", nullptr,
                              [&](const StreamEntry& e, const torch::Tensor& t) {
                                torch::NoGradGuard ng;
                                reg->find(e.name)->tensor.copy_(t);
                              });
    std::string data;
    uint64_t off = 0;
    while (s->next(&data, &off)) r.feed(data.data(), data.size());
    r.finish();
    return s->total_bytes();
  }
};

// A node's trainable tensors as it would upload them: the published values plus `delta`.
inline NamedTensors trained(const FakeNode& n, const RoundState& st, double delta) {
  NamedTensors t;
  for (const auto& e : n.reg->entries())
    if (e.trainable)
      t.emplace_back(e.name,
                     st.model().tensors().at(st.model().plan().index(e.name)).clone() + delta);
  return t;
}

inline SafetensorsStreamWriter upload_of(const FakeNode& n, int64_t round, NamedTensors t,
                                  int64_t tokens = 80) {
  return SafetensorsStreamWriter(std::move(t), torch::kFloat32,
                                 upload_metadata({n.id.node_id, round, round * 10, tokens,
                                                  n.id.incarnation, n.reg->fingerprint()}));
}

// Node n's upload of `round` under ownership epoch `epoch`'s map `o`: its trainable tensors
// (shared + the experts `o` gives it) at the published value + delta.
inline SafetensorsStreamWriter upload_under(const FakeNode& n, const RoundState& st,
                                            const Ownership& o, int64_t epoch, int64_t round,
                                            double delta) {
  const ParamRegistry reg(*n.model, n.cfg, o, n.id.node_id);
  NamedTensors t;
  for (const auto& e : reg.entries())
    if (e.trainable)
      t.emplace_back(e.name,
                     st.model().tensors().at(st.model().plan().index(e.name)).clone() + delta);
  UploadMeta meta{n.id.node_id, round, round * 10, 80, n.id.incarnation, reg.fingerprint()};
  meta.ownership_epoch = epoch;
  return SafetensorsStreamWriter(std::move(t), torch::kFloat32, upload_metadata(meta));
}

// Makes writes past `bytes` fail (EFBIG) in this process, as a full disk would.
struct FileSizeLimit {
  rlimit old{};
  explicit FileSizeLimit(rlim_t bytes) {
    std::signal(SIGXFSZ, SIG_IGN);
    getrlimit(RLIMIT_FSIZE, &old);
    rlimit lim = old;
    lim.rlim_cur = bytes;
    setrlimit(RLIMIT_FSIZE, &lim);
  }
  void lift() { setrlimit(RLIMIT_FSIZE, &old); }
  ~FileSizeLimit() { lift(); }
};

// Streams an upload to the server in 1000-byte chunks; `corrupt_chunk` flips a byte of that
// chunk after its checksum was taken.
inline UploadResult send_upload(RoundState& st, const NodeId& id, int64_t round,
                               const SafetensorsStreamWriter& w, int corrupt_chunk = -1) {
  auto s = st.begin_upload(id, round, round * 10, w.total_bytes());
  const uint64_t chunk = 1000;  // several chunks even for the tiny model
  int k = 0;
  for (uint64_t off = 0; off < w.total_bytes(); off += chunk, ++k) {
    std::string data;
    w.read(off, chunk, &data);
    std::string sha = chunk_checksum(data);
    if (k == corrupt_chunk) data[data.size() / 2] ^= 1;
    s->chunk(off, data, sha);
  }
  return s->finish();
}

// Issue 38 item 6: two initial nodes (node 0 owns experts 0-2, node 1 expert 3 of one layer)
// and node id 2 admitted to arrive mid-run (spes_config.max_nodes=3).
inline Config arrival_config(std::vector<std::string> more = {}) {
  more.insert(more.end(), {"spes_config.max_nodes=3", "spes_config.expert_owners=[[0,0,0,1]]"});
  return tiny_config(more);
}
// Round 1 with nodes 0 and 1 alone (the vacant id 2 holds nothing up).
inline void arrival_round_1(RoundState& st, const FakeNode& a, const FakeNode& b) {
  st.join(a.join_info());
  st.join(b.join_info());
  send_upload(st, a.id, 1, upload_of(a, 1, trained(a, st, 0.001)));
  send_upload(st, b.id, 1, upload_of(b, 1, trained(b, st, 0.001)));
}
// Node 2 arrives (declaring room for one expert per layer) and round 2 takes the three uploads:
// at its close node 2 takes expert 2 from node 0 (the only node with two to give), ownership
// epoch 1 from round 3.
inline void arrival_round_2(RoundState& st, const FakeNode& a, const FakeNode& b,
                            const FakeNode& c) {
  JoinInfo j = c.join_info();
  j.expert_capacity = 1;
  st.join(j);
  for (const FakeNode* n : {&a, &b, &c})
    send_upload(st, n->id, 2, upload_of(*n, 2, trained(*n, st, 0.002)));
}

// Nodes `a` and `b` join, `a` uploads round 1 and `b` departs for good at step 10: round 1
// publishes with `a` alone, and with reassignment on `b`'s experts go to `a` from round 2.
inline void departure_in_round_1(RoundState& st, const FakeNode& a, const FakeNode& b) {
  st.join(a.join_info());
  st.join(b.join_info());
  send_upload(st, a.id, 1, upload_of(a, 1, trained(a, st, 0.001)));
  st.leave(b.id, 10, "for good", LeaveKind::Departing);
}

// The message of what f() throws ("" when it throws nothing).
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// The SyncErrc that f() throws (Internal when it throws none).
inline SyncErrc code_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const SyncError& e) {
    return e.code();
  }
  return SyncErrc::Internal;
}

}  // namespace spes::sync::testing
