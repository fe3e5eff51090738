// Dense -> MoE upcycling: attention, norms, embeddings and LM head copied; every expert of a
// layer a copy of that layer's dense SwiGLU MLP (gate_proj -> W1, up_proj -> V1,
// down_proj -> W2), optionally noised (a fraction of entries gets Gaussian noise); the router
// initialised small and random (or zero). With normalised top-k and no noise the MoE computes
// the dense model's function exactly (the top-k weights sum to 1 over identical experts).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "spes/model/transformer.h"

namespace spes {

struct UpcycleOptions {
  int64_t experts = 8;
  int64_t top_k = 2;
  bool norm_topk_prob = true;        // the upcycled model equals the dense one only with true
  double noise_std = 0.0;            // std of the Gaussian noise added to expert entries
  double noise_fraction = 0.0;       // fraction of each expert matrix's entries that get noise
  std::string router_init = "normal";  // normal | scaled_normal | zeros
  double router_std = 0.02;          // std of `normal` (scaled_normal: 1/sqrt(d_model))
  uint64_t seed = 0;                 // noise and router draws
};

// The MoE model config for a dense config.
ModelConfig upcycle_config(const ModelConfig& dense, const UpcycleOptions& o);

// The upcycled model (CPU, fp32, no grad). Throws when `dense` is not a dense model.
std::unique_ptr<Transformer> upcycle_model(const Transformer& dense, const UpcycleOptions& o);

// `spes upcycle`: source (HF directory or checkpoint, dense) -> MoE checkpoint at out_dir
// (atomic; fresh optimizer state unless weights_only; tokenizer carried over). Returns the
// upcycled model config.
ModelConfig upcycle_to_checkpoint(const std::string& from, const std::string& out_dir,
                                  const UpcycleOptions& o, int64_t max_seq_len, bool weights_only,
                                  bool overwrite);

}  // namespace spes
