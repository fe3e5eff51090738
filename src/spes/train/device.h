// Device and precision selection: "auto" picks CUDA when libtorch sees a GPU, else CPU; on
// CUDA the default precision is bf16 autocast over fp32 master weights (amp_bf16 also runs on
// CPU, slowly, which tests use); the model's storage layout for them is model_runtime_for()
// (model/runtime_layout.h, included here). AutocastScope turns autocast on for one forward
// pass. torch_build_summary() says which libtorch this is.
#pragma once
#include <torch/torch.h>

#include <vector>

#include "spes/io/config.h"
#include "spes/model/runtime_layout.h"

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
