// DistGroup (see distributed.h): TCPStore rendezvous and a Gloo or NCCL backend.
#include "spes/train/distributed.h"

#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>

#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/train/dist_backends.h"

namespace spes {

struct DistGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
};

std::unique_ptr<DistGroup> DistGroup::from_environment() {
  const char* rank = std::getenv(kDistRankEnv);
  if (!rank) return nullptr;
  const char* size = std::getenv(kDistSizeEnv);
  const char* store = std::getenv(kDistStoreEnv);
  const char* backend = std::getenv(kDistBackendEnv);
  SPES_CHECK(size && store && backend, "{} is set but {}, {} or {} is not: rank processes are "
             "started by --nproc-per-node, which sets all four", kDistRankEnv, kDistSizeEnv,
             kDistStoreEnv, kDistBackendEnv);
  const std::string addr = store;
  const auto colon = addr.rfind(':');
  SPES_CHECK(colon != std::string::npos, "{}='{}' is not host:port", kDistStoreEnv, addr);
  try {
    return std::make_unique<DistGroup>(std::stoi(rank), std::stoi(size), addr.substr(0, colon),
                                       std::stoi(addr.substr(colon + 1)), backend);
  } catch (const std::invalid_argument&) {
    fail("{}='{}', {}='{}' or the port of {}='{}' is not a number", kDistRankEnv, rank,
         kDistSizeEnv, size, kDistStoreEnv, addr);
  }
}

DistGroup::DistGroup(int rank, int size, const std::string& store_host, int store_port,
                     const std::string& backend)
    : impl_(std::make_unique<Impl>()), rank_(rank), size_(size), backend_name_(backend) {
  SPES_CHECK(size >= 1 && rank >= 0 && rank < size, "rank {} of {} processes is out of range",
             rank, size);
  SPES_CHECK(backend == "gloo" || backend == "nccl",
             "distributed backend must be gloo or nccl, found '{}'", backend);
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(store_port);
  so.isServer = false;  // the launcher hosts the store
  so.waitWorkers = false;
  so.useLibUV = false;
  impl_->store = c10::make_intrusive<c10d::TCPStore>(store_host, so);
  impl_->backend = backend == "nccl"
                       ? dist_detail::make_nccl_backend(impl_->store, rank, size)
                       : dist_detail::make_gloo_backend(impl_->store, rank, size);
}

DistGroup::~DistGroup() = default;

torch::Device DistGroup::device() const {
  if (backend_name_ == "nccl") return torch::Device(torch::kCUDA, static_cast<int8_t>(rank_));
  return torch::kCPU;
}

std::function<void()> DistGroup::all_reduce_sum_async(std::vector<torch::Tensor> tensors) {
  if (tensors.empty()) return [] {};
  c10::intrusive_ptr<c10d::Work> work =
      tensors.size() == 1 ? impl_->backend->allreduce(tensors)
                          : impl_->backend->allreduce_coalesced(tensors);
  // The tensors stay referenced until the wait (the collective writes into them).
  return [work, tensors] { work->wait(); };
}

void DistGroup::all_reduce_sum(std::vector<torch::Tensor> tensors) {
  all_reduce_sum_async(std::move(tensors))();
}

void DistGroup::broadcast(torch::Tensor t) {
  SPES_CHECK(t.is_contiguous(), "internal: broadcast needs a contiguous tensor");
  std::vector<torch::Tensor> v = {t};
  c10d::BroadcastOptions o;
  o.rootRank = 0;
  impl_->backend->broadcast(v, o)->wait();
}

void DistGroup::barrier() { impl_->backend->barrier()->wait(); }

void broadcast_from_rank0(DistGroup& group, const std::vector<torch::Tensor>& tensors) {
  torch::NoGradGuard ng;
  for (const auto& t : tensors) {
    torch::Tensor d = t.detach();
    group.broadcast(d);
    torch::autograd::impl::bump_version(d);
  }
}

}  // namespace spes
