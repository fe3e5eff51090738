// Device and precision selection: "auto" picks CUDA when libtorch sees a GPU, else CPU; on
// CUDA the default precision is bf16 autocast over fp32 master weights (amp_bf16 also runs on
// CPU, slowly, which tests use). model_runtime_for() turns precision, activation checkpointing
// and what the node trains into the model's storage layout. AutocastScope turns autocast on for
// one forward pass. torch_build_summary() says which libtorch this is.
#pragma once
#include <torch/torch.h>

#include <vector>

#include "spes/io/config.h"
#include "spes/model/transformer.h"

namespace spes {

torch::Device select_device(const Config& cfg);
// Whether this process can use a CUDA GPU, and how many it sees; both load libtorch_cuda first
// when the machine has an NVIDIA driver (train/cuda_library.h). Use these, not
// torch::cuda::is_available(), which only sees CUDA once it is loaded.
bool cuda_available();
int64_t cuda_device_count();
// The device a setting names: auto (CUDA when libtorch sees a GPU, else CPU), cpu, cuda or
// cuda:N (checked against the GPUs this process sees).
torch::Device device_from_setting(const DeviceSetting& device);
// The same for a --device flag's text (refused with the allowed forms).
torch::Device device_from_name(const std::string& name);
// True when the config asks for (or "auto" implies) bf16 autocast on this device.
bool use_bf16_autocast(const Config& cfg, const torch::Device& device);
// The model's layout for training on `device` (trainable: [layer][expert] for this node, see
// trainable_expert_table in train/registry.h):
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
// Sets the intra-op thread count (cfg.threads, or every core when 0).
void configure_threads(const Config& cfg);
// "libtorch 2.11.0, CPU GEMM OpenBLAS 0.3.21, core Cooperlake (OpenBLAS's choice), CUDA 13.0,
// GPUs visible: 1" ("CUDA: not loaded: no NVIDIA driver ..." when libtorch_cuda is not loaded,
// "CUDA: no (...)" for a CPU-only libtorch, train/cuda_library.h's torch_cuda_status()):
// the version built against, the library serving fp32 CPU matrix products (CMake's
// SPES_CPU_BLAS) and its core (common/cpu_blas.h), whether CUDA is loaded, and the GPUs this
// process sees.
std::string torch_build_summary();

// bf16 autocast on `device`'s type (CUDA or CPU) for the scope's lifetime.
class AutocastScope {
 public:
  AutocastScope(bool enabled, torch::DeviceType device = torch::kCUDA);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool enabled_;
  torch::DeviceType device_;
};

}  // namespace spes
