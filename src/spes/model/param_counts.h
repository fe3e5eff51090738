// Parameter counts of a run's model, for one node, in closed form: the model's tensor shapes
// (model/transformer.h) summed from the config, and which experts the node owns and trains
// from the ownership map and the trainable-expert table, the same ones the parameter registry
// uses (model/registry.h: shared tensors always train; experts as the table says). No tensor
// is made, so a model of any size is counted at once, before anything is allocated.
// tests/model/param_counts_test.cpp checks every count against the registry of the model the
// trainer builds.
#pragma once
#include <cstdint>

#include "spes/io/config.h"

namespace spes {

struct ParamCounts {
  int64_t total = 0;             // P: every tensor
  int64_t shared = 0;            // S: embeddings, attention, norms, routers, LM head
  int64_t experts = 0;           // X: every expert of every layer (0 for a dense model)
  int64_t own_experts = 0;       // X_i: the experts `node` owns (ownership map)
  int64_t trainable = 0;         // what `node` trains: gradients, AdamW moments, uploads
  int64_t active_per_token = 0;  // S + X x top_k / E: the weights one token's forward uses
};

// Values of every tensor of the model `m` describes (ParamCounts::total), in double so that a
// config of any size (a million layers, a huge d_model) is counted without overflow: exact
// below 2^53.
double model_values(const ModelConfig& m);

// Counts for node `node` of the run `cfg` (spes_config.mode, ownership and frozen_experts
// decide `trainable`: shared + own experts in spes mode, everything in the other modes).
ParamCounts param_counts(const Config& cfg, int64_t node);
// Counts for a node that trains `experts_per_layer` experts of every MoE layer (and the shared
// tensors), whichever they are: the map a server is about to decide (issue 38). own_experts is
// what it trains; frozen_experts plays no part. Throws unless 0 <= experts_per_layer <= E.
ParamCounts param_counts_training(const Config& cfg, int64_t experts_per_layer);

}  // namespace spes
