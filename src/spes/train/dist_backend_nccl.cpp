// The NCCL backend of DistGroup: libtorch_cuda's ProcessGroupNCCL. Its options embed NCCL's
// ncclConfig_t, so this file compiles against the nccl.h of the NCCL that the torch wheel
// depends on (nvidia-nccl-cu13, found next to torch by CMake); the sizes below were read from
// the wheel's own allocations (operator new in ProcessGroupNCCL::split and in the Python
// binding of Options, torch 2.11.0) and are checked at compile time.
#include "spes/common/build_features.h"
#include "spes/train/dist_backends.h"
#include "spes/common/error.h"

#if SPES_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/version.h>
#endif

namespace spes::dist_detail {

#if SPES_WITH_CUDA
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 11
static_assert(sizeof(c10d::ProcessGroupNCCL) == 1112,
              "ProcessGroupNCCL's size differs from libtorch 2.11's (1112 bytes): wrong nccl.h?");
static_assert(sizeof(c10d::ProcessGroupNCCL::Options) == 248,
              "ProcessGroupNCCL::Options' size differs from libtorch 2.11's (248 bytes): wrong "
              "nccl.h?");
#else
#error "spes builds against libtorch 2.11 (re-check the c10d layouts in dist_backend_*.cpp)"
#endif

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size) {
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(rank));
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size,
                                                     c10d::ProcessGroupNCCL::Options::create());
}
#else
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>&, int,
                                                    int) {
  fail("this spes was built against a libtorch without CUDA: NCCL is not available (use the "
       "CUDA build of PyTorch, or CPU ranks with Gloo)");
}
#endif

}  // namespace spes::dist_detail
