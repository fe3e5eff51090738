// Dense -> MoE upcycling: attention, norms, embeddings and LM head copied; every expert of a
// layer a copy of that layer's dense SwiGLU MLP (gate_proj -> W1, up_proj -> V1,
// down_proj -> W2), optionally noised (Gaussian noise on a random subset of exactly
// floor(fraction x entries) entries of each expert matrix); the router initialised small and
// random (or zero). Two recipes set the defaults: `copy` (exact copies, router normal(0, 0.02):
// with normalised top-k the MoE computes the dense model's function exactly, the top-k weights
// summing to 1 over identical experts) and `reference` (the reference's 9B model from Qwen3-1.7B:
// noise std 0.02 on half of the entries of every expert's gate/up/down matrix, each router
// drawn from a normal with the std of that layer's dense down_proj).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "spes/model/transformer.h"

namespace spes {

struct UpcycleOptions {
  std::string recipe = "copy";       // copy | reference: where the defaults below came from
  int64_t experts = 8;
  int64_t top_k = 2;
  bool norm_topk_prob = true;        // the upcycled model equals the dense one only with true
  double noise_std = 0.0;            // std of the Gaussian noise added to expert entries
  double noise_fraction = 0.0;       // fraction of each expert matrix's entries that get noise
  // normal (std router_std) | scaled_normal (std 1/sqrt(d_model)) | zeros |
  // down_proj_std (std of the layer's dense down_proj weight)
  std::string router_init = "normal";
  double router_std = 0.02;
  uint64_t seed = 0;                 // noise and router draws
};

// The options of a recipe (copy or reference), with `experts` and `top_k` left at their
// defaults for the caller to set. Throws on another name.
UpcycleOptions upcycle_recipe(const std::string& name);

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
