// Micro-batches on several threads at once, each into its own gradients (see
// micro_batch_workers.h).
#include "spes/train/micro_batch_workers.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <unordered_map>

#include "spes/common/error.h"

namespace spes {

MicroBatchWorkers::MicroBatchWorkers(const Transformer& model,
                                     const std::vector<RegistryEntry>& trainable,
                                     int64_t workers)
    : model_(model), workers_(std::max<int64_t>(1, workers)) {
  for (const auto& e : trainable) trainable_.push_back(e.tensor);
  if (workers_ == 1) return;
  std::unordered_map<const c10::TensorImpl*, size_t> index;  // model tensor -> params() index
  for (size_t i = 0; i < model.params().size(); ++i)
    index.emplace(model.params()[i].tensor.unsafeGetTensorImpl(), i);
  torch::NoGradGuard ng;
  for (int64_t r = 1; r < workers_; ++r) {
    replicas_.push_back(std::make_unique<Transformer>(model.replica_sharing_weights()));
    std::vector<torch::Tensor> aliases;
    std::vector<Mark> marks;
    for (const auto& t : trainable_) {
      auto it = index.find(t.unsafeGetTensorImpl());
      SPES_CHECK(it != index.end(), "internal: a trainable tensor is not one of the model's");
      torch::Tensor a = replicas_.back()->params()[it->second].tensor;
      a.mutable_grad() = torch::zeros_like(a, torch::MemoryFormat::Contiguous);
      marks.push_back(mark_of(a.grad()));
      aliases.push_back(a);
    }
    replica_params_.push_back(std::move(aliases));
    zeroed_.push_back(std::move(marks));
  }
}

MicroBatchWorkers::~MicroBatchWorkers() = default;

MicroBatchWorkers::Mark MicroBatchWorkers::mark_of(const torch::Tensor& grad) {
  return {grad.unsafeGetTensorImpl(), grad._version()};
}

int64_t MicroBatchWorkers::workers_for(int64_t micro_batches, torch::Device device) {
  if (!device.is_cpu()) return 1;
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), micro_batches));
}

void MicroBatchWorkers::run(int64_t n, const std::function<void(const Transformer&, int64_t)>& fn) {
  if (workers_ == 1 || n <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(model_, i);
    return;
  }
  // Which tensors train may change between steps (a registry decides); the replicas follow.
  for (auto& aliases : replica_params_)
    for (size_t i = 0; i < aliases.size(); ++i)
      if (aliases[i].requires_grad() != trainable_[i].requires_grad())
        aliases[i].set_requires_grad(trainable_[i].requires_grad());
  // One OpenMP team with a worker per thread: inside it ATen's parallel_for and OpenBLAS see a
  // parallel region and run on the calling thread. The caller's grad mode, autocast and other
  // thread-local state go with each worker.
  const at::ThreadLocalState state;
  at::parallel_for(0, workers_, 1, [&](int64_t begin, int64_t end) {
    at::ThreadLocalStateGuard guard(state);
    for (int64_t w = begin; w < end; ++w) {
      const Transformer& m = w == 0 ? model_ : *replicas_[w - 1];
      for (int64_t i = w; i < n; i += workers_) fn(m, i);
    }
  });
  reduce_into_model();
}

void MicroBatchWorkers::reduce_into_model() {
  torch::NoGradGuard ng;
  for (size_t r = 0; r < replicas_.size(); ++r) {
    for (size_t i = 0; i < trainable_.size(); ++i) {
      const torch::Tensor& rg = replica_params_[r][i].grad();
      if (!rg.defined() || mark_of(rg) == zeroed_[r][i]) continue;  // untouched
      torch::Tensor& g = trainable_[i].mutable_grad();
      if (g.defined()) {
        g.add_(rg);
      } else {
        g = rg.clone();
      }
      rg.zero_();
      zeroed_[r][i] = mark_of(rg);
    }
  }
}

int64_t MicroBatchWorkers::replica_grad_bytes() const {
  int64_t bytes = 0;
  for (const auto& aliases : replica_params_)
    for (const auto& a : aliases)
      if (a.grad().defined()) bytes += a.grad().nbytes();
  return bytes;
}

}  // namespace spes
