// The tiny model shape shared by the model tests (fast enough for finite differences), and a
// SPES run of it.
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

// The tiny model (d 16, 2 layers, 4 experts top-2, F 12, V 32) as a SPES run of 2 nodes.
inline Config tiny_spes_config() {
  Config cfg;
  cfg.model = tiny_model_config();
  cfg.spes_config.mode = "spes";
  cfg.spes_config.num_peers = 2;
  return cfg;
}

}  // namespace spes::testing
