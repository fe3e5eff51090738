// How a run's model is stored on a device: model_runtime_for() turns precision, activation
// checkpointing and what the node trains into the model's storage layout (ModelRuntime,
// model/transformer.h); use_bf16_autocast() says when a config trains in bf16 autocast. The
// trainer builds its model with them, and the memory estimate (model/memory_estimate.h) counts
// the same layout. Leaves out: choosing the device (train/device.h).
#pragma once
#include <torch/torch.h>

#include <vector>

#include "spes/io/config.h"
#include "spes/model/transformer.h"

namespace spes {

// True when the config asks for (or "auto" implies) bf16 autocast on this device.
bool use_bf16_autocast(const Config& cfg, const torch::Device& device);
// The model's layout for training on `device` (trainable: [layer][expert] for this node, see
// trainable_expert_table in model/registry.h):
// - grouped experts (expert_stack.h) on CUDA, or under amp_bf16: bf16 stacks under amp_bf16,
//   fp32 ones otherwise; the fp32 CPU path keeps one tensor per expert (fused CPU kernels);
// - frozen experts in bf16 under amp_bf16, except on a SPES/FedAvg/DiLoCo node with
//   spes_config.transfer_dtype fp32 (it must reproduce the published fp32 weights bit for bit,
//   which the sync round checks; with transfer_dtype bf16 they are bf16 values anyway);
// - activation checkpointing from cfg.activation_checkpointing.
// Grouped GEMMs need d_model and the expert hidden size to be multiples of 8; other shapes keep
// one tensor per expert (and fp32 frozen experts).
ModelRuntime model_runtime_for(const Config& cfg, const torch::Device& device,
                               const std::vector<std::vector<bool>>& trainable);

}  // namespace spes
