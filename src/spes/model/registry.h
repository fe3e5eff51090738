// The parameter registry: every tensor of the model with its name, role (shared or expert
// (layer, index)), owner node and trainable flag on this node. Freezing, the optimizer's
// parameter list, what a node uploads, how the server combines, what merging touches and what
// an export writes all read this one list, so they cannot disagree.
#pragma once
#include <torch/torch.h>

#include <string>
#include <unordered_map>
#include <vector>

#include "spes/io/config.h"
#include "spes/model/ownership.h"
#include "spes/model/transformer.h"

namespace spes {

struct RegistryEntry {
  std::string name;
  torch::Tensor tensor;
  ParamRole role = ParamRole::Shared;
  int64_t layer = -1, expert = -1;
  int64_t owner = -1;      // owning node of an expert; -1 for shared tensors
  bool trainable = false;  // trained on this node (requires_grad, optimizer state, uploaded)
};

class ParamRegistry {
 public:
  // Decides what this node trains: shared tensors always; experts by spes_config.mode
  // (spes: the experts `ownership` gives node_id; centralized, fedavg, diloco: all), minus any
  // listed in cfg.frozen_experts. Sets requires_grad on the model's tensors accordingly.
  ParamRegistry(const Transformer& model, const Config& cfg, const Ownership& ownership,
                int64_t node_id);
  // A copy on the CPU: every tensor cloned (same dtype, detached, no gradient), names, roles,
  // owners and trainable flags kept. What a node's round works on while its live weights keep
  // training (spes_config.overlap).
  ParamRegistry cpu_copy() const;

  const std::vector<RegistryEntry>& entries() const { return entries_; }
  std::vector<RegistryEntry> trainable() const;
  const RegistryEntry* find(const std::string& name) const;
  int64_t node_id() const { return node_id_; }

  int64_t trainable_numel() const;
  int64_t frozen_numel() const;
  // Digest of names, shapes and roles: equal fingerprints mean interchangeable models.
  std::string fingerprint() const;
  // The weights' digest (sync protocol 5 on): SHA-256 over, for every tensor in registry order,
  // its name and then the 64 lower-case hex digits of SHA-256 of its fp32 bytes. Per-tensor
  // digests let several threads share the work.
  std::string weights_sha256() const;
  // The digest of sync protocols 1-4: one SHA-256 over every tensor's name and fp32 bytes, in
  // registry order. Only to recognise a server directory written by those versions.
  std::string flat_weights_sha256() const;

 private:
  ParamRegistry() = default;
  std::vector<RegistryEntry> entries_;
  std::unordered_map<std::string, size_t> index_;
  int64_t node_id_ = 0;
};

// Parses cfg.frozen_experts ("layer:expert", "*:expert", "layer:*") into a predicate table
// [layer][expert] -> frozen. Throws on malformed or out-of-range entries.
std::vector<std::vector<bool>> frozen_expert_table(const Config& cfg);
// [layer][expert] -> trained on node_id: what ParamRegistry decides for experts (the model's
// storage layout is chosen from it before the registry exists; train/device.h).
std::vector<std::vector<bool>> trainable_expert_table(const Config& cfg,
                                                      const Ownership& ownership,
                                                      int64_t node_id);

}  // namespace spes
