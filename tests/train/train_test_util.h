// Helpers shared by the training tests: a raw uint32 token shard (the reference format) of a
// noisy repeating pattern, learnable in a few steps, reading a run's metrics.jsonl, and a
// trainable registry entry for the optimizer's tests.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

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
