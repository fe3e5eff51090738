// Device and precision selection: "auto" picks CUDA when libtorch sees a GPU, else CPU; on
// CUDA the default precision is bf16 autocast over fp32 master weights. AutocastScope turns
// autocast on for one forward pass. torch_build_summary() says which libtorch this is.
#pragma once
#include <torch/torch.h>

#include "spes/io/config.h"

namespace spes {

torch::Device select_device(const Config& cfg);
// True when the config asks for (or "auto" implies) bf16 autocast on this device.
bool use_bf16_autocast(const Config& cfg, const torch::Device& device);
// Sets the intra-op thread count (cfg.threads, or every core when 0).
void configure_threads(const Config& cfg);
// "libtorch 2.11.0, CPU GEMM OpenBLAS 0.3.21, CUDA 13.0, GPUs visible: 1" ("CUDA: no" for a
// CPU-only libtorch): the version built against, the library serving fp32 CPU matrix products
// (CMake's SPES_CPU_BLAS), whether CUDA is compiled in, and the GPUs this process sees.
std::string torch_build_summary();
// "OpenBLAS 0.3.21" or "MKL (libtorch's)": the library that ATen's sgemm_ calls reach.
std::string cpu_gemm_library();

class AutocastScope {
 public:
  explicit AutocastScope(bool enabled);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool enabled_;
};

}  // namespace spes
