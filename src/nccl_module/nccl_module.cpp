// libspes_nccl.so: the NCCL backend of DistGroup (libtorch_cuda's ProcessGroupNCCL) behind one C
// function, loaded with dlopen by src/spes/train/dist_backend_nccl.cpp when ranks on GPUs ask
// for it. Why a module: ProcessGroupNCCL lives in libtorch_cuda, which the binaries do not link
// (they load it only where a GPU is used, train/cuda_library.h); this is the one piece of spes
// that needs its symbols at link time.
// Its options embed NCCL's ncclConfig_t, so this file compiles against the nccl.h of the NCCL
// that the torch wheel depends on (nvidia-nccl-cu13, found next to torch by CMake); the sizes
// below were read from the wheel's own allocations (operator new in ProcessGroupNCCL::split and
// in the Python binding of Options, torch 2.11.0) and are checked at compile time.
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/version.h>

#include <cstring>
#include <exception>
#include <string>

#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 11
static_assert(sizeof(c10d::ProcessGroupNCCL) == 1112,
              "ProcessGroupNCCL's size differs from libtorch 2.11's (1112 bytes): wrong nccl.h?");
static_assert(sizeof(c10d::ProcessGroupNCCL::Options) == 248,
              "ProcessGroupNCCL::Options' size differs from libtorch 2.11's (248 bytes): wrong "
              "nccl.h?");
#else
#error "spes builds against libtorch 2.11 (re-check the c10d layouts in nccl_module.cpp)"
#endif

// A new ProcessGroupNCCL for `rank` of `size` on cuda:rank over `store` (borrowed: the backend
// takes its own reference). Returns the backend with one reference owned by the caller
// (c10::intrusive_ptr<c10d::Backend>::reclaim), or nullptr with the reason in `error`.
extern "C" __attribute__((visibility("default"))) c10d::Backend* spes_nccl_backend_new(
    c10d::Store* store, int rank, int size, char* error, size_t error_size) {
  try {
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(rank));
    auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(
        c10::intrusive_ptr<c10d::Store>::reclaim_copy(store), rank, size,
        c10d::ProcessGroupNCCL::Options::create());
    return c10::intrusive_ptr<c10d::Backend>(std::move(pg)).release();
  } catch (const c10::Error& e) {
    std::strncpy(error, e.what_without_backtrace(), error_size - 1);
  } catch (const std::exception& e) {
    std::strncpy(error, e.what(), error_size - 1);
  }
  error[error_size - 1] = '\0';
  return nullptr;
}
