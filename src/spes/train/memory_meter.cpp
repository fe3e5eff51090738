// Measured tensor memory on CPU and CUDA (see memory_meter.h).
#include "spes/train/memory_meter.h"

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstring>
#include <mutex>

#include "spes/common/build_features.h"
#include "spes/common/error.h"

#if SPES_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace spes {
namespace {

// Wraps the CPU allocator: every allocation's bytes are added to `current` until freed.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    auto* ctx = new Ctx{std::move(inner), n, this};
    add(static_cast<int64_t>(n));
    return {data, ctx, &CountingAllocator::free_ctx, c10::Device(c10::DeviceType::CPU)};
  }
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
  struct Ctx {
    c10::DataPtr inner;
    size_t bytes;
    CountingAllocator* owner;
  };
  static void free_ctx(void* p) {
    auto* ctx = static_cast<Ctx*>(p);
    ctx->owner->current.fetch_sub(static_cast<int64_t>(ctx->bytes));
    delete ctx;  // frees the inner allocation
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
#if SPES_WITH_CUDA
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index() < 0 ? 0 : device.index());
#endif
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
#if SPES_WITH_CUDA
    c10::cuda::CUDACachingAllocator::resetPeakStats(
        impl_->device.index() < 0 ? 0 : impl_->device.index());
#endif
    return;
  }
  impl_->counting->peak.store(impl_->counting->current.load());
}

GpuMemoryStats gpu_memory_stats(const torch::Device& device) {
  GpuMemoryStats s;
#if SPES_WITH_CUDA
  if (!device.is_cuda() || !torch::cuda::is_available()) return s;
  const auto st = c10::cuda::CUDACachingAllocator::getDeviceStats(
      device.index() < 0 ? 0 : device.index());
  const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  s.allocated = st.allocated_bytes[agg].current;
  s.peak_allocated = st.allocated_bytes[agg].peak;
  s.reserved = st.reserved_bytes[agg].current;
#else
  (void)device;
#endif
  return s;
}

}  // namespace spes
