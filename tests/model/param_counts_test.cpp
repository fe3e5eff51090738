// Parameter counts in closed form (model/param_counts.h): by hand from the model's dimensions,
// and against the registry of the model the trainer builds (on the meta device), for dense and
// MoE models, every QK-norm, grouped key/value heads, padded embeddings, each sync mode,
// frozen experts and explicit ownership maps, on every node.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "tiny_model_config.h"
#include "spes/model/ownership.h"
#include "spes/model/param_counts.h"
#include "spes/model/registry.h"
#include "spes/model/transformer.h"

namespace spes {
namespace {

using spes::testing::tiny_spes_config;

// The counts read off the registry of the model itself: what a run trains and uploads.
ParamCounts counts_from_registry(const Config& cfg, int64_t node) {
  torch::NoGradGuard no_grad;
  const Transformer model(cfg.model, torch::Device(torch::kMeta));
  const ParamRegistry reg(model, cfg, Ownership::from_config(cfg), node);
  ParamCounts c;
  for (const auto& e : reg.entries()) {
    const int64_t n = e.tensor.numel();
    c.total += n;
    (e.role == ParamRole::Shared ? c.shared : c.experts) += n;
    if (e.role == ParamRole::Expert && e.owner == node) c.own_experts += n;
    if (e.trainable) c.trainable += n;
  }
  int64_t active_experts = c.experts;
  if (cfg.model.is_moe()) {  // top_k of the E experts of every layer, counted tensor by tensor
    active_experts = 0;
    for (const auto& e : reg.entries())
      if (e.role == ParamRole::Expert && e.expert < cfg.model.moe_top_k)
        active_experts += e.tensor.numel();
  }
  c.active_per_token = c.shared + active_experts;
  return c;
}

TEST(ParamCounts, MatchCountsFromTheDimensions) {
  Config cfg = tiny_spes_config();
  const int64_t d = 16, L = 2, E = 4, F = 12, V = 32;
  const int64_t expert = 3 * d * F, X = L * E * expert;
  const int64_t S = 2 * V * d + d + L * (4 * d * d + 2 * d + 2 * d + E * d);
  const ParamCounts c = param_counts(cfg, 1);
  EXPECT_EQ(c.total, S + X);
  EXPECT_EQ(c.shared, S);
  EXPECT_EQ(c.experts, X);
  EXPECT_EQ(c.own_experts, L * 2 * expert);
  EXPECT_EQ(c.trainable, S + L * 2 * expert);
  EXPECT_EQ(c.active_per_token, S + L * 2 * expert);  // top-2 of 4
  cfg.frozen_experts = {"*:2"};  // frozen on every node: neither trained nor owned-and-trained
  EXPECT_EQ(param_counts(cfg, 1).trainable, S + L * expert);
  cfg.model.embedding_size = 40;  // padded rows in the embedding and the head
  EXPECT_EQ(param_counts(cfg, 1).total, S + X + 2 * 8 * d);
}

TEST(ParamCounts, EqualTheRegistryOfTheModelTheTrainerBuilds) {
  const std::vector<std::pair<std::string, std::function<void(Config&)>>> cases = {
      {"spes, 2 nodes", [](Config&) {}},
      {"dense", [](Config& c) { c.model.block_type = "dense"; }},
      {"dense, per-head QK-norm", [](Config& c) {
         c.model.block_type = "dense";
         c.model.qk_norm = "per_head";
       }},
      {"per-head QK-norm, grouped key/value heads", [](Config& c) {
         c.model.qk_norm = "per_head";
         c.model.n_heads = 4;
         c.model.n_kv_heads = 2;
       }},
      {"whole QK-norm, grouped key/value heads", [](Config& c) {
         c.model.n_heads = 4;
         c.model.n_kv_heads = 1;
       }},
      {"no QK-norm", [](Config& c) { c.model.qk_norm = "none"; }},
      {"padded embedding", [](Config& c) { c.model.embedding_size = 40; }},
      {"top-1 of 4", [](Config& c) { c.model.moe_top_k = 1; }},
      {"fedavg", [](Config& c) { c.spes_config.mode = "fedavg"; }},
      {"centralized", [](Config& c) { c.spes_config.mode = "centralized"; }},
      {"frozen experts", [](Config& c) { c.frozen_experts = {"0:*", "1:2"}; }},
      {"per-layer owners", [](Config& c) {
         c.spes_config.expert_owners = {{0, 0, 1, 1}, {1, 0, 1, 0}};
       }},
      {"4 nodes, one expert each, 3 layers", [](Config& c) {
         c.model.n_layers = 3;
         c.spes_config.num_peers = 4;
         c.spes_config.num_train_experts_per_node = 1;
       }},
  };
  for (const auto& [name, edit] : cases) {
    Config cfg = tiny_spes_config();
    edit(cfg);
    for (int64_t node = 0; node < cfg.spes_config.num_peers; ++node) {
      SCOPED_TRACE(name + ", node " + std::to_string(node));
      const ParamCounts want = counts_from_registry(cfg, node), got = param_counts(cfg, node);
      EXPECT_EQ(got.total, want.total);
      EXPECT_EQ(got.shared, want.shared);
      EXPECT_EQ(got.experts, want.experts);
      EXPECT_EQ(got.own_experts, want.own_experts);
      EXPECT_EQ(got.trainable, want.trainable);
      EXPECT_EQ(got.active_per_token, want.active_per_token);
    }
  }
}

TEST(ParamCounts, CountAMillionLayersFromTheConfigAlone) {
  // A million layers of the tiny model (3.5G values, 14 GB in fp32): counted from the config
  // alone (the ownership map and trainable table are a few bytes per expert), as a size check
  // before building a model must be.
  Config cfg = tiny_spes_config();
  cfg.model.n_layers = 1000000;
  const ParamCounts c = param_counts(cfg, 0);
  const Config one = [] {
    Config o = tiny_spes_config();
    o.model.n_layers = 1;
    return o;
  }();
  const ParamCounts layer = param_counts(one, 0), none = [] {
    Config o = tiny_spes_config();
    o.model.n_layers = 0;
    return param_counts(o, 0);
  }();
  EXPECT_EQ(c.total, none.total + 1000000 * (layer.total - none.total));
  EXPECT_EQ(c.trainable, none.trainable + 1000000 * (layer.trainable - none.trainable));
}

}  // namespace
}  // namespace spes
