// The Gloo backend of DistGroup. The PyTorch wheel ships libtorch's ProcessGroupGloo (its
// constructor and device factories are exported by libtorch_cpu) but not gloo's headers, which
// ProcessGroupGloo.hpp includes; Debian's libgloo-dev provides them. Only the constructor, the
// options struct and the Backend interface are used here, and every one of their members is a
// smart pointer, a container or a scalar, so the layout does not depend on the gloo version;
// the sizes below were read from the wheel's own allocations (operator new in
// ProcessGroupGloo::split and Options::create_default, torch 2.11.0) and are checked at compile
// time, so a torch whose layout differs fails to build instead of corrupting memory.
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/version.h>

#include "spes/train/dist_backends.h"

namespace spes::dist_detail {

#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 11
static_assert(sizeof(c10d::ProcessGroupGloo) == 488,
              "ProcessGroupGloo's size differs from libtorch 2.11's (488 bytes)");
static_assert(sizeof(c10d::ProcessGroupGloo::Options) == 176,
              "ProcessGroupGloo::Options' size differs from libtorch 2.11's (176 bytes)");
#else
#error "spes builds against libtorch 2.11 (re-check the c10d layouts in dist_backend_*.cpp)"
#endif

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size) {
  auto opts = c10d::ProcessGroupGloo::Options::create();
  opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
}

}  // namespace spes::dist_detail
