// The tiny model shape shared by the model tests (fast enough for finite differences).
#pragma once
#include "spes/io/config.h"

namespace spes::testing {

inline ModelConfig tiny_model_config() {
  ModelConfig c;
  c.d_model = 16;
  c.n_layers = 2;
  c.n_heads = 2;
  c.mlp_hidden_size = 24;  // F = 12 (OLMo: the SwiGLU width 2F)
  c.moe_num_experts = 4;
  c.moe_top_k = 2;
  c.vocab_size = 32;
  c.max_sequence_length = 8;
  c.rope_theta = 10000.0;
  return c;
}

}  // namespace spes::testing
