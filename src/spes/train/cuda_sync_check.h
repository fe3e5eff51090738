// c10's check for host synchronisations on CUDA (the C++ side of
// torch.cuda.set_sync_debug_mode): every blocking device-to-host copy, .item(), stream or device
// synchronisation that goes through c10's CUDA helpers is reported, as a warning or as an error
// (c10::Error "called a synchronizing CUDA operation"). libtorch_cuda is loaded at run time
// (train/cuda_library.h), so its state is reached by symbol, not linked. Used by the test that a
// training step never waits for the device (tests/train/cuda_sync_test.cpp) and by train_bench
// (--sync-check: host synchronisations counted per step at the benchmark's shapes).
// Leaves out: implicit synchronisations outside c10's helpers (cudaMalloc when the caching
// allocator grows, cudaFree when it empties), which a warmed-up step does not make.
#pragma once
#include <cstdint>
#include <memory>

namespace spes {

enum class CudaSyncDebug { Off = 0, Warn = 1, Error = 2 };  // c10::cuda::SyncDebugMode's values

// Sets the process-wide mode; throws spes::Error when libtorch_cuda is not loaded.
void set_cuda_sync_debug(CudaSyncDebug mode);
CudaSyncDebug cuda_sync_debug();

// While alive: the Error mode (a synchronisation throws), restored to the previous mode after.
class CudaSyncForbidden {
 public:
  CudaSyncForbidden();
  ~CudaSyncForbidden();
  CudaSyncForbidden(const CudaSyncForbidden&) = delete;
  CudaSyncForbidden& operator=(const CudaSyncForbidden&) = delete;

 private:
  CudaSyncDebug previous_;
};

// While alive: the Warn mode, and the calling thread's c10 warnings that report a
// synchronisation are counted instead of printed (others pass on to the previous handler;
// autograd replays the warnings of its device threads on the thread that ran backward).
class CudaSyncCounter {
 public:
  CudaSyncCounter();
  ~CudaSyncCounter();
  CudaSyncCounter(const CudaSyncCounter&) = delete;
  CudaSyncCounter& operator=(const CudaSyncCounter&) = delete;
  int64_t count() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spes
