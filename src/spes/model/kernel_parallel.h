// at::parallel_for for the fused kernels' bodies that call torch operators: OpenMP worker
// threads start with grad mode on, so each task runs with the caller's grad mode (inside a
// custom autograd Function that is off: out= products would otherwise refuse tensors that
// require grad, and backward's products would build graphs instead of accumulating in place).
#pragma once
#include <ATen/Parallel.h>
#include <torch/torch.h>

namespace spes {

template <class F>
void parallel_for_in_grad_mode(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const bool grad_mode = torch::GradMode::is_enabled();
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    c10::AutoGradMode mode(grad_mode);
    f(b, e);
  });
}

}  // namespace spes
