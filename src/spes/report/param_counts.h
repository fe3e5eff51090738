// Parameter counts of a run's model, for one node: read off the model the trainer builds (made
// on the meta device, so shapes only and no memory, whatever the size) and the parameter
// registry (which tensors are shared, which experts the node owns, what it trains). The same
// registry decides freezing, the optimizer's list and uploads, so these counts are what a run
// does, not a separate formula.
#pragma once
#include <cstdint>

#include "spes/io/config.h"

namespace spes::report {

struct ParamCounts {
  int64_t total = 0;             // P: every tensor
  int64_t shared = 0;            // S: embeddings, attention, norms, routers, LM head
  int64_t experts = 0;           // X: every expert of every layer (0 for a dense model)
  int64_t own_experts = 0;       // X_i: the experts `node` owns (ownership map)
  int64_t trainable = 0;         // what `node` trains: gradients, AdamW moments, uploads
  int64_t active_per_token = 0;  // S + X x top_k / E: the weights one token's forward uses
};

// Counts for node `node` of the run `cfg` (spes_config.mode, ownership and frozen_experts
// decide `trainable`: shared + own experts in spes mode, everything in the other modes).
ParamCounts param_counts(const Config& cfg, int64_t node);

}  // namespace spes::report
