// Device, precision and thread settings (see device.h).
#include "spes/train/device.h"

#include <ATen/autocast_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/version.h>

#include "spes/common/error.h"
#include "spes/common/sysinfo.h"

namespace spes {

torch::Device select_device(const Config& cfg) {
  if (cfg.device == "auto") return torch::cuda::is_available() ? torch::kCUDA : torch::kCPU;
  if (cfg.device == "cpu") return torch::kCPU;
  SPES_CHECK(cfg.device.rfind("cuda", 0) == 0,
             "config: device must be auto, cpu, cuda or cuda:N, found '{}'", cfg.device);
  SPES_CHECK(torch::cuda::is_available(),
             "config: device '{}' requested but this libtorch sees no CUDA GPU (build against a "
             "CUDA-enabled libtorch, or set device: cpu)", cfg.device);
  return torch::Device(cfg.device);
}

bool use_bf16_autocast(const Config& cfg, const torch::Device& device) {
  if (cfg.precision == "fp32") return false;
  if (cfg.precision == "amp_bf16") {
    SPES_CHECK(device.is_cuda(), "config: precision amp_bf16 needs a CUDA device; on CPU use "
               "precision: fp32 (or auto)");
    return true;
  }
  return device.is_cuda();  // auto
}

void configure_threads(const Config& cfg) {
  const int n = cfg.threads > 0 ? static_cast<int>(cfg.threads) : cpu_cores();
  at::set_num_threads(n);
}

std::string torch_build_summary() {
  std::string s = fmt::format("libtorch {}", TORCH_VERSION);
  const auto& hooks = at::detail::getCUDAHooks();
  long cudart = 0;
  try {
    cudart = hooks.versionCUDART();  // throws when libtorch has no CUDA library
  } catch (const c10::Error&) {
  }
  if (cudart <= 0) return s + ", CUDA: no";
  s += fmt::format(", CUDA {}.{}", cudart / 1000, (cudart % 1000) / 10);
  const int64_t n = torch::cuda::is_available() ? torch::cuda::device_count() : 0;
  return s + fmt::format(", GPUs visible: {}", n);
}

AutocastScope::AutocastScope(bool enabled) : enabled_(enabled) {
  if (!enabled_) return;
  at::autocast::set_autocast_enabled(at::kCUDA, true);
  at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!enabled_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(at::kCUDA, false);
}

}  // namespace spes
