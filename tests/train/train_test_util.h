// Helpers shared by the training tests: a raw uint32 token shard (the reference format) of a
// noisy repeating pattern, learnable in a few steps, the tiny MoE config the trainer tests
// train on it, reading a run's metrics.jsonl, and a trainable registry entry for the
// optimizer's tests.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "spes/io/config.h"
#include "spes/model/registry.h"

namespace spes::test {

inline std::string make_pattern_shard(const std::filesystem::path& dir, int64_t n_tokens,
                                      int64_t vocab) {
  std::filesystem::create_directories(dir);
  std::vector<uint32_t> toks(n_tokens);
  std::mt19937 rng(3);
  for (int64_t i = 0; i < n_tokens; ++i)
    toks[i] = (rng() % 10 == 0) ? rng() % vocab : static_cast<uint32_t>((i * 7) % vocab);
  const std::string path = (dir / "tokens.bin").string();
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(toks.data()), toks.size() * 4);
  return path;
}

// The tiny MoE config of the trainer tests: 2 layers of 4 experts (top 2), d_model 32, vocab 64,
// sequences of 16, batches of 8 in 2 micro-batches of 4, lr 3e-3 with 2 warm-up steps, one CPU
// thread, reading `shard` for `steps` steps. Not validated: a test sets what it varies, then
// calls config_validate.
inline Config tiny_train_config(const std::string& shard, int64_t steps) {
  Config c;
  c.model.d_model = 32;
  c.model.n_layers = 2;
  c.model.n_heads = 2;
  c.model.mlp_hidden_size = 32;
  c.model.moe_num_experts = 4;
  c.model.moe_top_k = 2;
  c.model.vocab_size = 64;
  c.model.max_sequence_length = 16;
  c.optimizer.learning_rate = 3e-3;
  c.scheduler.t_warmup = 2;
  c.scheduler.t_max = steps;
  c.data.paths = {shard};
  c.max_duration = std::to_string(steps);
  c.global_train_batch_size = 8;
  c.device_train_microbatch_size = 4;
  c.threads = 1;
  c.device = "cpu";
  return c;
}

inline std::vector<nlohmann::json> read_metrics(const std::filesystem::path& dir) {
  std::vector<nlohmann::json> out;
  std::ifstream f(dir / "metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

// A trainable tensor for AdamW, under `name` (requires_grad set).
inline RegistryEntry trainable_entry(const std::string& name, torch::Tensor t) {
  RegistryEntry e;
  e.name = name;
  e.tensor = t.set_requires_grad(true);
  e.trainable = true;
  return e;
}

}  // namespace spes::test
