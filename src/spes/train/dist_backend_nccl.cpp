// The NCCL backend of DistGroup, from libspes_nccl.so (src/nccl_module/nccl_module.cpp): loaded
// with libtorch_cuda the first time ranks on GPUs need it, so that nothing else in spes links
// against CUDA.
#include <dlfcn.h>

#include "spes/common/build_features.h"
#include "spes/common/error.h"
#include "spes/common/shared_module.h"
#include "spes/train/cuda_library.h"
#include "spes/train/dist_backends.h"

#ifndef SPES_NCCL_MODULE_BUILD_PATH
#define SPES_NCCL_MODULE_BUILD_PATH ""
#endif
#ifndef SPES_NCCL_MODULE_INSTALL_PATH
#define SPES_NCCL_MODULE_INSTALL_PATH ""
#endif

namespace spes::dist_detail {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size) {
  SPES_CHECK(SPES_WITH_CUDA, "this spes was built against a libtorch without CUDA: NCCL is not "
             "available (use the CUDA build of PyTorch, or CPU ranks with Gloo)");
  load_torch_cuda();
  using NewBackend = c10d::Backend* (*)(c10d::Store*, int, int, char*, size_t);
  static const NewBackend new_backend = [] {
    const SharedModule m{"libspes_nccl.so", "SPES_NCCL_MODULE", SPES_NCCL_MODULE_BUILD_PATH,
                         SPES_NCCL_MODULE_INSTALL_PATH};
    void* h = open_shared_module(m, RTLD_NOW | RTLD_LOCAL);
    return reinterpret_cast<NewBackend>(shared_module_symbol(h, m, "spes_nccl_backend_new"));
  }();
  char error[1024] = {0};
  c10d::Backend* backend = new_backend(store.get(), rank, size, error, sizeof error);
  SPES_CHECK(backend, "rank {} of {}: NCCL backend on cuda:{} failed: {}", rank, size, rank,
             error);
  return c10::intrusive_ptr<c10d::Backend>::reclaim(backend);
}

}  // namespace spes::dist_detail
