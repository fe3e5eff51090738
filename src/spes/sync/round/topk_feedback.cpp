// Error feedback of top-k sparse deltas (see topk_feedback.h).
#include "spes/sync/round/topk_feedback.h"

#include "spes/common/error.h"

namespace spes::sync {

void TopkFeedback::reset(size_t tensors) {
  held_.assign(tensors, torch::Tensor());
}

TopkEncoded TopkFeedback::encode(size_t k, const torch::Tensor& change, const std::string& name) {
  SPES_CHECK(k < held_.size(), "topk feedback: tensor {} of {} (internal)", k, held_.size());
  torch::NoGradGuard ng;
  torch::Tensor a = change.detach().to(torch::kCPU, torch::kFloat32).contiguous().clone();
  const torch::Tensor& h = held_[k];
  if (h.defined()) {
    SPES_CHECK(h.numel() == a.numel(), "topk feedback: '{}' has {} values, its accumulator {}",
               name, a.numel(), h.numel());
    a += decay_ == 1.0 ? h.view(a.sizes()) : h.view(a.sizes()) * decay_;
  }
  TopkEncoded e = topk_encode_tensor(a, p_, name);  // throws before anything is kept
  held_[k] = a - e.deq;
  return e;
}

void TopkFeedback::restore(std::vector<torch::Tensor> held) {
  for (auto& t : held)
    if (t.defined()) t = t.to(torch::kCPU, torch::kFloat32).contiguous();
  held_ = std::move(held);
}

double TopkFeedback::held_sq() const {
  double s = 0;
  for (const auto& t : held_)
    if (t.defined()) s += t.to(torch::kDouble).pow(2).sum().item<double>();
  return s;
}

}  // namespace spes::sync
