// Helpers shared by the interop tests: tiny models with every weight random (norm weights too,
// so a misplaced or transposed tensor changes the logits), checkpoints written from them, and
// bitwise comparison of two models.
#pragma once
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>

#include "data/data_test_util.h"
#include "model/tiny_model_config.h"
#include "spes/common/error.h"
#include "spes/interop/model_build.h"
#include "spes/model/transformer.h"

namespace spes::interop_test {

using spes::test::TempDir;

inline const std::string kNeoxTokenizer =
    std::string(SPES_ASSETS_DIR) + "/tokenizers/gpt-neox-olmo-dolma-v1_5.json";

// The shared tiny shape with per-tensor knobs: MoE, whole QK-norm, raw top-k by default.
inline ModelConfig tiny(const std::string& block = "moe", const std::string& qk = "whole",
                        bool norm_topk = false, int64_t kv_heads = 0) {
  ModelConfig c = spes::testing::tiny_model_config();
  c.n_heads = 4;  // head_dim 4: per-head norms differ from whole-vector ones
  c.block_type = block;
  c.qk_norm = qk;
  c.moe_norm_topk_prob = norm_topk;
  c.n_kv_heads = kv_heads;
  c.eos_token_id = 3;
  return c;
}

// A model with random weights everywhere (1-D weights around 1).
inline std::unique_ptr<Transformer> random_model(const ModelConfig& m, uint64_t seed) {
  auto model = std::make_unique<Transformer>(m, torch::kCPU);
  torch::NoGradGuard ng;
  torch::manual_seed(seed);
  for (const auto& p : model->params()) {
    if (p.tensor.dim() == 1)
      p.tensor.copy_(1.0 + 0.3 * torch::randn(p.tensor.sizes()));
    else
      p.tensor.copy_(0.3 * torch::randn(p.tensor.sizes()));
  }
  return model;
}

inline Config config_of(const ModelConfig& m) {
  Config c;
  c.model = m;
  return c;
}

// Token ids [1, T] fixed by a seed.
inline torch::Tensor sample_tokens(const ModelConfig& m, int64_t T, uint64_t seed) {
  torch::manual_seed(seed);
  return torch::randint(0, m.vocab_size, {1, T}, torch::kInt64);
}

// Every tensor equal bit for bit (names and order too).
inline void expect_same_weights(const Transformer& a, const Transformer& b) {
  ASSERT_EQ(a.params().size(), b.params().size());
  for (size_t i = 0; i < a.params().size(); ++i) {
    EXPECT_EQ(a.params()[i].name, b.params()[i].name);
    EXPECT_TRUE(torch::equal(a.params()[i].tensor, b.params()[i].tensor))
        << a.params()[i].name;
  }
}

// The message of the spes::Error that f throws, or "(no error)".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace spes::interop_test
