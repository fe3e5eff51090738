// Helpers shared by the sync tests: a self-deleting temporary directory, a tiny MoE config and
// hand-made uploads.
#pragma once
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "spes/io/config.h"
#include "spes/sync/aggregate.h"

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
      "\n  n_heads: 2\n  mlp_hidden_size: 4\n"
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

}  // namespace spes::sync::testing
