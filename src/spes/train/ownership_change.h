// Changing the experts a node trains inside the running process (issue 38): the checks that
// come before anything changes (a map of the model's shape, the same map on every rank of a
// --nproc-per-node group, handed moments that fit the experts gained), rank 0's handed moments
// shared with the other ranks, and the re-warm-up length the config asks for.
// Trainer::change_ownership and Trainer::expert_moments (train/trainer.h) are defined here too:
// they put these steps in order over the trainer's parts.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "spes/io/config.h"
#include "spes/model/ownership.h"
#include "spes/model/registry.h"
#include "spes/train/distributed.h"
#include "spes/train/optimizer.h"

namespace spes {

// Steps of the re-warm-up of experts gained without moments: spes_config.rewarmup_steps, its
// -1 meaning the scheduler's t_warmup (0: none).
int64_t rewarmup_steps_for(const Config& cfg);

// Throws (naming `origin`, changing nothing) unless every entry of `handed` is a tensor of an
// expert that is trainable in `after` and not in `before` ([layer][expert] tables,
// trainable_expert_table), with all three tensors of that expert present, both moments fp32 of
// the tensor's shape (the registry's), finite, exp_avg_sq >= 0, and step >= 0.
void check_handed_moments(const ExpertMoments& handed, const ParamRegistry& registry,
                          const std::vector<std::vector<bool>>& before,
                          const std::vector<std::vector<bool>>& after, const std::string& origin);

// Every rank: throws on all ranks unless they all hold `next` (its fingerprint).
void check_ranks_hold_map(DistGroup& group, const Ownership& next, const torch::Device& device);

// Every rank: rank 0 checks its `handed` (check_handed_moments; null: none) and every rank
// gets rank 0's moments of the gained tensors (`gained`: their registry entries, the same list
// on every rank); all ranks throw when rank 0's are refused. Returns the moments (empty: none).
ExpertMoments share_handed_moments(DistGroup& group, const ExpertMoments* handed,
                                   const std::vector<RegistryEntry>& gained,
                                   const torch::Device& device,
                                   const std::function<void(const ExpertMoments&)>& check);

}  // namespace spes
