// Device, precision and thread settings (see device.h).
#include "spes/train/device.h"

#include <ATen/autocast_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/version.h>

#include "spes/common/cpu_blas.h"
#include "spes/common/error.h"
#include "spes/common/sysinfo.h"
#include "spes/train/cuda_library.h"

namespace spes {

bool cuda_available() {
  load_torch_cuda_if_driver();
  return torch::cuda::is_available();
}

int64_t cuda_device_count() { return cuda_available() ? torch::cuda::device_count() : 0; }

torch::Device device_from_setting(const DeviceSetting& device) {
  if (device.kind() == DeviceSetting::Kind::Auto)
    return cuda_available() ? torch::kCUDA : torch::kCPU;
  if (device.kind() == DeviceSetting::Kind::Cpu) return torch::kCPU;
  const std::string name = device.name();
  SPES_CHECK(nvidia_driver_present(), "device '{}' requested but this machine has no NVIDIA "
             "driver (libcuda.so.1 not found): install the driver, or use device cpu", name);
  load_torch_cuda();
  SPES_CHECK(torch::cuda::is_available(),
             "device '{}' requested but this libtorch sees no CUDA GPU (CUDA_VISIBLE_DEVICES? "
             "a driver older than CUDA 13.0? or use device cpu)", name);
  SPES_CHECK(device.index() < torch::cuda::device_count(),
             "device '{}' requested but only {} GPU(s) are visible", name,
             torch::cuda::device_count());
  return device.index() >= 0 ? torch::Device(torch::kCUDA, device.index())
                             : torch::Device(torch::kCUDA);
}

torch::Device device_from_name(const std::string& name) {
  DeviceSetting d;
  try {
    d = DeviceSetting(name);
  } catch (const Error& e) {
    fail("device {}", e.what());
  }
  return device_from_setting(d);
}

torch::Device select_device(const Config& cfg) {
  try {
    return device_from_setting(cfg.device);
  } catch (const Error& e) {
    fail("config: {}", e.what());
  }
}

void configure_threads(const Config& cfg) {
  const int n = cfg.threads > 0 ? static_cast<int>(cfg.threads) : cpu_cores();
  at::set_num_threads(n);
}

std::string torch_build_summary() {
  std::string s = fmt::format("libtorch {}, CPU GEMM {}", TORCH_VERSION, cpu_blas_summary());
  if (!torch_cuda_loaded()) return s + ", CUDA: " + torch_cuda_status();
  // Loaded: its hooks are registered, so the runtime's version is known, unless libtorch had
  // asked for them before the load (it keeps its first answer: a process that loaded CUDA
  // late, as the tests of the loader do on a machine without a driver).
  try {
    const long cudart = at::detail::getCUDAHooks().versionCUDART();
    s += fmt::format(", CUDA {}.{}", cudart / 1000, (cudart % 1000) / 10);
  } catch (const c10::Error&) {
    return s + ", CUDA: loaded after libtorch's first CUDA query (not usable in this process)";
  }
  return s + fmt::format(", GPUs visible: {}", cuda_device_count());
}

AutocastScope::AutocastScope(bool enabled, torch::DeviceType device)
    : enabled_(enabled), device_(device) {
  if (!enabled_) return;
  at::autocast::set_autocast_enabled(device_, true);
  at::autocast::set_autocast_dtype(device_, at::kBFloat16);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!enabled_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_, false);
}

}  // namespace spes
