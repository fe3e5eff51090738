// Measured memory of tensors, to check the memory report against (report/, bench/): on CPU a
// counting wrapper around libtorch's CPU allocator, installed for the lifetime of a MemoryMeter
// (current and peak bytes of every CPU tensor storage allocated meanwhile); on CUDA the caching
// allocator's own statistics (bytes handed to tensors, current and peak since the reset).
// Leaves out: allocations outside libtorch (gRPC, the tokenizer, malloc of our own code) and
// the caching allocator's unused reserve.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <memory>

namespace spes {

class MemoryMeter {
 public:
  // Starts measuring on `device`: on CPU installs the counting allocator (one meter at a time
  // per process), on CUDA resets the peak statistic.
  explicit MemoryMeter(const torch::Device& device);
  ~MemoryMeter();  // on CPU puts the previous allocator back
  MemoryMeter(const MemoryMeter&) = delete;
  MemoryMeter& operator=(const MemoryMeter&) = delete;

  int64_t current_bytes() const;  // tensor bytes allocated since the start and not yet freed
  int64_t peak_bytes() const;     // the most current_bytes() has been
  // Makes the peak the current value (to measure one phase, e.g. a step after the first).
  void reset_peak();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Bytes the CUDA caching allocator has given to tensors on `device` now and at most since the
// last reset (0 and 0 without CUDA).
struct GpuMemoryStats {
  int64_t allocated = 0, peak_allocated = 0, reserved = 0;
};
GpuMemoryStats gpu_memory_stats(const torch::Device& device);

}  // namespace spes
