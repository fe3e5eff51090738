// Data parallelism across the cores of one machine: the micro-batches of an optimizer step run
// on several threads at once, each thread with single-threaded kernels, instead of one
// micro-batch at a time with every kernel split over the threads. Worker w computes
// micro-batches w, w + W, ... on its own replica of the model (the same weight storage, its own
// gradient buffers; worker 0 uses the model itself); afterwards the replicas' gradients are
// added into the model's, in worker order, so the result is deterministic for a given W.
//
// Why: a step of small GEMMs, attention blocks and element-wise passes, each split over two
// threads, pays a fork/join and a load imbalance in every kernel; two independent backward
// passes pay neither (bench/train_bench --micro-batch measures both ways).
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <vector>

#include "spes/model/registry.h"
#include "spes/model/transformer.h"

namespace spes {

class MicroBatchWorkers {
 public:
  // trainable: the model's trainable tensors (the registry's list). workers <= 1 runs the
  // micro-batches one after the other on the calling thread (kernels use the intra-op threads).
  MicroBatchWorkers(const Transformer& model, const std::vector<RegistryEntry>& trainable,
                    int64_t workers);
  ~MicroBatchWorkers();

  // Workers for n micro-batches on this machine: min(intra-op threads, n) on CPU, else 1.
  static int64_t workers_for(int64_t micro_batches, torch::Device device);

  int64_t workers() const { return workers_; }
  // Runs fn(model_or_replica, i) for i in [0, n): fn does the forward and backward pass of
  // micro-batch i (its gradients accumulate into that model's .grad). Returns when every
  // gradient is in the model's own .grad. The first exception of any worker is rethrown.
  void run(int64_t n, const std::function<void(const Transformer&, int64_t)>& fn);
  // Bytes of the replicas' gradient buffers (the memory this parallelism costs).
  int64_t replica_grad_bytes() const;

 private:
  void reduce_into_model();

  const Transformer& model_;
  std::vector<torch::Tensor> trainable_;  // the model's trainable tensors
  int64_t workers_;
  std::vector<std::unique_ptr<Transformer>> replicas_;  // workers_ - 1 of them
  // Per replica, its aliases of trainable_ (same order) and each gradient buffer and version
  // when it was last zeroed (changed: the replica computed a gradient for that tensor).
  using Mark = std::pair<const c10::TensorImpl*, uint32_t>;
  static Mark mark_of(const torch::Tensor& grad);
  std::vector<std::vector<torch::Tensor>> replica_params_;
  std::vector<std::vector<Mark>> zeroed_;
};

}  // namespace spes
