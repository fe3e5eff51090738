// The processes of one multi-GPU (or multi-process CPU) node as a torch.distributed (c10d)
// group: a TCPStore for rendezvous, then NCCL on CUDA or Gloo on CPU. Rank r of N drives
// cuda:r on a GPU node. The group is set up from SPES_DIST_* environment variables, which the
// rank launcher (train/rank_launcher.h) sets for the processes it starts. Collectives are the
// few the trainer needs: sums (asynchronous, for gradient buckets overlapped with backward),
// broadcasts from rank 0 and a barrier. Leaves out: groups spanning machines (SPES nodes talk
// to each other only through the sync server), sub-groups, other collectives.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace spes {

// Environment of a rank process (set by the launcher; absent in a single-process run).
constexpr const char* kDistRankEnv = "SPES_DIST_RANK";
constexpr const char* kDistSizeEnv = "SPES_DIST_WORLD_SIZE";
constexpr const char* kDistStoreEnv = "SPES_DIST_STORE";      // host:port of the TCPStore
constexpr const char* kDistBackendEnv = "SPES_DIST_BACKEND";  // gloo | nccl

class DistGroup {
 public:
  // Joins the group described by the SPES_DIST_* variables; null when they are absent.
  static std::unique_ptr<DistGroup> from_environment();
  // backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors; rank r uses cuda:r).
  DistGroup(int rank, int size, const std::string& store_host, int store_port,
            const std::string& backend);
  ~DistGroup();
  DistGroup(const DistGroup&) = delete;
  DistGroup& operator=(const DistGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& backend() const { return backend_name_; }
  // The device this rank computes on: cuda:rank for NCCL, CPU for Gloo.
  torch::Device device() const;

  // Sums the tensors (one dtype and device) over the ranks, in place. The async form starts the
  // collective and returns the function that waits for it (on CUDA: makes the current stream
  // wait, without blocking the host).
  std::function<void()> all_reduce_sum_async(std::vector<torch::Tensor> tensors);
  void all_reduce_sum(std::vector<torch::Tensor> tensors);
  // Rank 0's values of t on every rank, in place.
  void broadcast(torch::Tensor t);
  void barrier();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int rank_, size_;
  std::string backend_name_;
};

// Rank 0's values of every tensor on every rank (in place; their version counters are bumped,
// so views and copies kept by version, e.g. expert stacks, see the change).
void broadcast_from_rank0(DistGroup& group, const std::vector<torch::Tensor>& tensors);

}  // namespace spes
