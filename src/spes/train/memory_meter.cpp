// Measured tensor memory on CPU and CUDA (see memory_meter.h).
#include "spes/train/memory_meter.h"

#include <ATen/Context.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "spes/common/build_features.h"
#include "spes/common/error.h"

#include <c10/core/CachingDeviceAllocator.h>

namespace spes {
namespace {

// The CUDA caching allocator through c10's device-generic interface: libtorch_cuda registers it
// when it is loaded (train/cuda_library.h), so nothing here links against CUDA. Its per-device
// state exists only once CUDA is initialised, which the first CUDA tensor does lazily: a meter
// made before any (train_bench with --peak-tflops) found none ("Invalid device argument"), so
// CUDA is initialised here first (once per process; a no-op later).
c10::DeviceAllocator* cuda_allocator() {
  SPES_CHECK(torch::cuda::is_available(), "internal: GPU memory measured without a usable GPU");
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  return c10::getDeviceAllocator(c10::DeviceType::CUDA);
}

class CountingAllocator;

// Every live counted allocation, by data pointer: the inner allocation, its size and the
// allocator that counted it. The data pointer is also the DataPtr's context, as
// c10::Allocator::raw_allocate requires (oneDNN's bf16 matmuls allocate their scratch that way
// on CPUs with AVX512-BF16), so one deleter serves DataPtrs and raw_deallocate. Never
// destroyed: allocations made while a meter was installed may be freed after it is gone.
struct Live {
  c10::DataPtr inner;
  size_t bytes;
  CountingAllocator* owner;
};
std::mutex& live_mu() {
  static auto* m = new std::mutex;
  return *m;
}
std::unordered_map<void*, Live>& live() {
  static auto* m = new std::unordered_map<void*, Live>;
  return *m;
}

// Wraps the CPU allocator: every allocation's bytes are added to `current` until freed.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;  // zero bytes: nothing to count
    {
      std::lock_guard<std::mutex> lk(live_mu());
      live().insert_or_assign(data, Live{std::move(inner), n, this});
    }
    add(static_cast<int64_t>(n));
    return {data, data, &CountingAllocator::free_data, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::free_data; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  void add(int64_t n) {
    const int64_t now = current.fetch_add(n) + n;
    int64_t p = peak.load();
    while (now > p && !peak.compare_exchange_weak(p, now)) {}
  }

  std::atomic<int64_t> current{0}, peak{0};

 private:
  static void free_data(void* data) {
    if (data == nullptr) return;
    c10::DataPtr inner;  // freed after the lock is released
    {
      std::lock_guard<std::mutex> lk(live_mu());
      auto it = live().find(data);
      if (it == live().end()) return;
      it->second.owner->current.fetch_sub(static_cast<int64_t>(it->second.bytes));
      inner = std::move(it->second.inner);
      live().erase(it);
    }
  }
  c10::Allocator* inner_;
};

std::mutex g_meter_mu;
bool g_meter_active = false;

}  // namespace

struct MemoryMeter::Impl {
  torch::Device device = torch::kCPU;
  c10::Allocator* previous = nullptr;
  // Never deleted: storages allocated while it was installed may outlive the meter and still
  // call its deleter (which only touches the counters).
  CountingAllocator* counting = nullptr;
};

MemoryMeter::MemoryMeter(const torch::Device& device) : impl_(std::make_unique<Impl>()) {
  impl_->device = device;
  if (device.is_cuda()) {
    SPES_CHECK(SPES_WITH_CUDA, "this spes has no CUDA: cannot measure GPU memory");
    cuda_allocator()->resetPeakStats(device.index() < 0 ? 0 : device.index());
    return;
  }
  std::lock_guard<std::mutex> lk(g_meter_mu);
  SPES_CHECK(!g_meter_active, "internal: one CPU memory meter at a time");
  g_meter_active = true;
  impl_->previous = c10::GetCPUAllocator();
  impl_->counting = new CountingAllocator(impl_->previous);
  c10::SetCPUAllocator(impl_->counting, /*priority=*/UINT8_MAX);
}

MemoryMeter::~MemoryMeter() {
  if (impl_->device.is_cuda()) return;
  std::lock_guard<std::mutex> lk(g_meter_mu);
  c10::SetCPUAllocator(impl_->previous, /*priority=*/UINT8_MAX);
  g_meter_active = false;
}

int64_t MemoryMeter::current_bytes() const {
  if (impl_->device.is_cuda()) return gpu_memory_stats(impl_->device).allocated;
  return impl_->counting->current.load();
}

int64_t MemoryMeter::peak_bytes() const {
  if (impl_->device.is_cuda()) return gpu_memory_stats(impl_->device).peak_allocated;
  return impl_->counting->peak.load();
}

void MemoryMeter::reset_peak() {
  if (impl_->device.is_cuda()) {
    cuda_allocator()->resetPeakStats(impl_->device.index() < 0 ? 0 : impl_->device.index());
    return;
  }
  impl_->counting->peak.store(impl_->counting->current.load());
}

GpuMemoryStats gpu_memory_stats(const torch::Device& device) {
  GpuMemoryStats s;
  if (!SPES_WITH_CUDA || !device.is_cuda() || !torch::cuda::is_available()) return s;
  const auto st = cuda_allocator()->getDeviceStats(device.index() < 0 ? 0 : device.index());
  const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  s.allocated = st.allocated_bytes[agg].current;
  s.peak_allocated = st.allocated_bytes[agg].peak;
  s.reserved = st.reserved_bytes[agg].current;
  return s;
}

}  // namespace spes
