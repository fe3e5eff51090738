// c10's CUDA synchronisation check (see cuda_sync_check.h).
#include "spes/train/cuda_sync_check.h"

#include <c10/util/Exception.h>
#include <dlfcn.h>

#include <atomic>
#include <string>

#include "spes/common/error.h"
#include "spes/train/cuda_library.h"

namespace spes {
namespace {

// c10::cuda::warning_state()'s object (c10/cuda/CUDAFunctions.h): a class holding one
// SyncDebugMode (an enum class over int: 0 disabled, 1 warn, 2 error), a function-local static
// of an inline function, exported by libc10_cuda (and unified with the copies of the libraries
// that inline it) as a unique global symbol.
constexpr const char* kWarningState = "_ZZN3c104cuda13warning_stateEvE14warning_state_";
// The message c10::cuda::warn_or_error_on_sync() reports.
constexpr const char* kSyncMessage = "called a synchronizing CUDA operation";

int* sync_debug_mode_field() {
  SPES_CHECK(torch_cuda_loaded(), "the CUDA synchronisation check needs libtorch_cuda, which is "
             "not loaded ({})", torch_cuda_status());
  void* sym = ::dlsym(RTLD_DEFAULT, kWarningState);
  SPES_CHECK(sym, "libc10_cuda does not export {} (a PyTorch other than 2.11?): cannot set the "
             "CUDA synchronisation check", kWarningState);
  return static_cast<int*>(sym);
}

}  // namespace

void set_cuda_sync_debug(CudaSyncDebug mode) { *sync_debug_mode_field() = static_cast<int>(mode); }

CudaSyncDebug cuda_sync_debug() { return static_cast<CudaSyncDebug>(*sync_debug_mode_field()); }

CudaSyncForbidden::CudaSyncForbidden() : previous_(cuda_sync_debug()) {
  set_cuda_sync_debug(CudaSyncDebug::Error);
}

CudaSyncForbidden::~CudaSyncForbidden() { set_cuda_sync_debug(previous_); }

struct CudaSyncCounter::Impl : public c10::WarningHandler {
  c10::WarningHandler* previous_handler = nullptr;
  CudaSyncDebug previous_mode = CudaSyncDebug::Off;
  std::atomic<int64_t> count{0};

  void process(const c10::Warning& w) override {
    if (w.msg().find(kSyncMessage) != std::string::npos) {
      count.fetch_add(1);
      return;
    }
    if (previous_handler) previous_handler->process(w);
  }
};

CudaSyncCounter::CudaSyncCounter() : impl_(std::make_unique<Impl>()) {
  impl_->previous_mode = cuda_sync_debug();
  impl_->previous_handler = c10::WarningUtils::get_warning_handler();
  c10::WarningUtils::set_warning_handler(impl_.get());
  set_cuda_sync_debug(CudaSyncDebug::Warn);
}

CudaSyncCounter::~CudaSyncCounter() {
  set_cuda_sync_debug(impl_->previous_mode);
  c10::WarningUtils::set_warning_handler(impl_->previous_handler);
}

int64_t CudaSyncCounter::count() const { return impl_->count.load(); }

}  // namespace spes
