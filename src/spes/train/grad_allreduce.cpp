// Bucketed gradient all-reduce overlapped with backward (see grad_allreduce.h).
#include "spes/train/grad_allreduce.h"

#include <torch/csrc/autograd/variable.h>

#include "spes/common/error.h"

namespace spes {
namespace {

// Bucket of a tensor: its block, L for the final norm and the head, L + 1 for the rest.
size_t bucket_of(const std::string& name, int64_t layers) {
  const std::string prefix = "model.layers.";
  if (name.rfind(prefix, 0) == 0) {
    const size_t end = name.find('.', prefix.size());
    return static_cast<size_t>(std::stoll(name.substr(prefix.size(), end - prefix.size())));
  }
  if (name == "lm_head.weight" || name == "model.norm.weight") return static_cast<size_t>(layers);
  return static_cast<size_t>(layers + 1);
}

}  // namespace

GradientAllReduce::GradientAllReduce(DistGroup& group, const Transformer& model,
                                     AdamW& optimizer)
    : group_(group), optimizer_(optimizer) {
  SPES_CHECK(optimizer.persistent_grads(), "internal: the gradient all-reduce needs persistent "
             "gradient buffers");
  const int64_t L = model.config().n_layers;
  buckets_.resize(L + 2);
  const auto& params = optimizer.params();
  for (size_t i = 0; i < params.size(); ++i)
    buckets_[bucket_of(params[i].name, L)].push_back(i);
  launched_.assign(buckets_.size(), true);
  present_.assign(params.size(), false);
  // With grouped experts (and in dense models) every trainable tensor gets a gradient buffer
  // write in every backward pass on every rank (an expert without tokens gets zeros), so no
  // rank can disagree about presence and nothing needs to wait for the host.
  exchange_presence_ = model.config().is_moe() && !model.runtime().grouped();
}

void GradientAllReduce::arm(const std::vector<torch::Tensor>& block_inputs) {
  SPES_CHECK(block_inputs.size() + 1 == buckets_.size(), "internal: {} block inputs for {} "
             "gradient buckets", block_inputs.size(), buckets_.size());
  launched_.assign(buckets_.size(), false);
  waits_.clear();
  for (size_t b = 0; b < block_inputs.size(); ++b) {
    if (!block_inputs[b].requires_grad()) continue;  // started by finish()
    // The gradient flows on unchanged; the hook only starts the bucket's reduction.
    block_inputs[b].register_hook([this, b](const torch::Tensor&) { launch(b); });
  }
}

void GradientAllReduce::launch(size_t b) {
  if (launched_[b]) return;
  launched_[b] = true;
  std::vector<torch::Tensor> grads;
  for (size_t i : buckets_[b]) {
    present_[i] = optimizer_.has_grad(i);
    grads.push_back(optimizer_.params()[i].tensor.grad());
  }
  waits_.push_back(group_.all_reduce_sum_async(std::move(grads)));
}

torch::Tensor GradientAllReduce::finish(const torch::Tensor& extra) {
  for (size_t b = 0; b < buckets_.size(); ++b) launch(b);  // in bucket order on every rank
  for (auto& w : waits_) w();
  waits_.clear();
  const auto& params = optimizer_.params();
  // The collectives wrote the buffers directly: mark them changed so that zero_grad clears them.
  for (const auto& p : params) torch::autograd::impl::bump_version(p.tensor.grad());
  const torch::Device dev = params.empty() ? extra.device() : params[0].tensor.device();
  if (!exchange_presence_) {  // stays on the device: read with the gradient norm
    torch::Tensor e = extra.reshape({-1}).to(dev, torch::kFloat64).clone();
    group_.all_reduce_sum({e});
    return e.view(extra.sizes());
  }
  torch::Tensor flags = torch::empty({static_cast<int64_t>(params.size())}, torch::kFloat64);
  for (size_t i = 0; i < params.size(); ++i) flags[i] = present_[i] ? 1.0 : 0.0;
  torch::Tensor packed = torch::cat({extra.reshape({-1}).to(torch::kCPU, torch::kFloat64), flags})
                             .to(dev);
  group_.all_reduce_sum({packed});
  packed = packed.to(torch::kCPU);
  std::vector<bool> present(params.size());
  const int64_t n_extra = extra.numel();
  for (size_t i = 0; i < params.size(); ++i)
    present[i] = packed[n_extra + static_cast<int64_t>(i)].item<double>() > 0;
  optimizer_.set_grad_presence(std::move(present));
  return packed.narrow(0, 0, n_extra).view(extra.sizes());
}

}  // namespace spes
