// Text generation: autoregressive sampling (temperature, top-k; temperature 0 = greedy) with a
// sliding window of the model's maximum sequence length. No KV cache: each new token reruns the
// window, which is fine for samples and tests, not for serving.
#pragma once
#include <cstdint>
#include <vector>

#include "spes/model/transformer.h"

namespace spes {

struct SampleOptions {
  int64_t max_new_tokens = 64;
  double temperature = 0.8;
  int64_t top_k = 40;
  uint64_t seed = 1;
  int64_t stop_token = -1;  // stop after emitting this token (e.g. EOS); -1: never
};

// Returns prompt + generated ids.
std::vector<int64_t> generate_tokens(const Transformer& model, std::vector<int64_t> prompt,
                                     const SampleOptions& opts);

}  // namespace spes
