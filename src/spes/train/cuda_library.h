// PyTorch's CUDA library, loaded at run time. The binaries link libtorch_cpu only; libtorch_cuda
// (with cuBLAS, cuSPARSE, NVRTC, ... behind it) is dlopen()ed when a process may use a GPU and
// the machine has an NVIDIA driver. A process that never uses a GPU (the sync server, most
// tools) or a machine without one keeps ~240 MiB of those libraries out of its memory
// (docs/PERFORMANCE.md, "The sync server without CUDA").
//
// Load it before the first torch call of the process: libtorch decides once, on first use,
// whether it has CUDA (at::detail::getCUDAHooks()), and a decision made before the load stays.
#pragma once
#include <string>

namespace spes {

// Whether the NVIDIA driver's library (libcuda.so.1) loads on this machine: without it no GPU
// can be used, so nothing loads libtorch_cuda.
bool nvidia_driver_present();

// Loads libtorch_cuda from the folder of the libtorch_cpu this process runs (same build, same
// version) and registers its CUDA kernels and hooks; idempotent and thread-safe. Throws
// spes::Error naming the library and the fix when it does not load.
void load_torch_cuda();

// The start of every process that may use a GPU: load_torch_cuda() when the driver is present.
void load_torch_cuda_if_driver();

// Whether libtorch_cuda is part of this process (loaded above, or by anything else).
bool torch_cuda_loaded();

// Why CUDA is or is not usable here, for --version and skip messages: "loaded", "not loaded:
// no NVIDIA driver (libcuda.so.1 not found)", "not loaded: this process does not use a GPU",
// "no (this libtorch has no CUDA)".
std::string torch_cuda_status();

}  // namespace spes
