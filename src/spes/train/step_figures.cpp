// A step's figures read without a host synchronisation inside the step (see step_figures.h).
#include "spes/train/step_figures.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace spes {

StepFigures::StepFigures(const torch::Tensor& values) {
  torch::NoGradGuard ng;
  const torch::Tensor v = values.detach().reshape({-1}).to(torch::kFloat64);
  if (v.is_cpu()) {
    host_ = v;
    return;
  }
  // Pinned memory: the device copies into it asynchronously (pageable memory would make the
  // copy wait). The event is recorded on the stream that runs the step (c10's device-generic
  // interface: libtorch_cuda is loaded at run time, train/cuda_library.h).
  host_ = torch::empty(v.sizes(),
                       torch::TensorOptions().dtype(torch::kFloat64).pinned_memory(true));
  host_.copy_(v, /*non_blocking=*/true);
  const c10::impl::VirtualGuardImpl guard(v.device().type());
  done_ = std::make_shared<c10::Event>(v.device().type());
  done_->record(guard.getStream(v.device()));
}

bool StepFigures::ready() const { return !done_ || done_->query(); }

torch::Tensor StepFigures::values() const {
  if (done_) done_->synchronize();
  return host_;
}

}  // namespace spes
