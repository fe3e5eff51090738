// libtorch_cuda loaded at run time (see cuda_library.h).
#include "spes/train/cuda_library.h"

#include <dlfcn.h>
#include <link.h>

#include <filesystem>
#include <mutex>

#include "spes/common/build_features.h"
#include "spes/common/error.h"

namespace spes {
namespace {
namespace fs = std::filesystem;

constexpr const char* kTorchCuda = "libtorch_cuda.so";

// The folder of the libtorch_cpu.so this process runs: libtorch_cuda.so of the same build lies
// beside it (the wheel's torch/lib, or a libtorch's lib/).
std::string torch_lib_dir() {
  std::string found;
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        const fs::path p = info->dlpi_name ? info->dlpi_name : "";
        if (p.filename() != "libtorch_cpu.so") return 0;
        *static_cast<std::string*>(out) = p.parent_path().string();
        return 1;
      },
      &found);
  return found;
}

}  // namespace

bool nvidia_driver_present() {
  static const bool present = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL) != nullptr;
  return present;
}

bool torch_cuda_loaded() {
  void* h = ::dlopen(kTorchCuda, RTLD_LAZY | RTLD_NOLOAD);
  if (h) ::dlclose(h);  // drops only the reference RTLD_NOLOAD just took
  return h != nullptr;
}

void load_torch_cuda() {
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    if (!SPES_WITH_CUDA) {
      error = "this spes was built against a libtorch without CUDA (build against the CUDA "
              "build of PyTorch: bash scripts/setup.sh installs it)";
      return;
    }
    if (torch_cuda_loaded()) return;
    const std::string dir = torch_lib_dir();
    const std::string path = dir.empty() ? kTorchCuda : (fs::path(dir) / kTorchCuda).string();
    // Global: what libtorch_cuda brings (cuBLAS, NCCL, ...) serves every later user in the
    // process, libspes_nccl.so included, as when it is linked in.
    if (!::dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
      const char* why = ::dlerror();
      error = fmt::format("cannot load PyTorch's CUDA library {}: {} (the CUDA build of "
                          "PyTorch 2.11 must be complete: reinstall it with bash "
                          "scripts/setup.sh, or use device cpu)",
                          path, why ? why : "dlopen failed");
    }
  });
  SPES_CHECK(error.empty(), "{}", error);
}

void load_torch_cuda_if_driver() {
  if (SPES_WITH_CUDA && nvidia_driver_present()) load_torch_cuda();
}

std::string torch_cuda_status() {
  if (!SPES_WITH_CUDA) return "no (this libtorch has no CUDA)";
  if (torch_cuda_loaded()) return "loaded";
  if (!nvidia_driver_present()) return "not loaded: no NVIDIA driver (libcuda.so.1 not found)";
  return "not loaded: this process does not use a GPU";
}

}  // namespace spes
