// Construction of the c10d backends behind DistGroup (distributed.h), one translation unit each
// because their headers need third-party headers of their own (gloo's, nccl.h) that nothing
// else should see. Internal to train/.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace spes::dist_detail {

// Gloo over loopback TCP (the ranks of one node share the machine).
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size);
// NCCL on cuda:rank. Throws when this build has no CUDA.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size);

}  // namespace spes::dist_detail
