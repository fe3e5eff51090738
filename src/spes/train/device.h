// Device and precision selection: "auto" picks CUDA when libtorch sees a GPU, else CPU; on
// CUDA the default precision is bf16 autocast over fp32 master weights. AutocastScope turns
// autocast on for one forward pass, across libtorch 1.13 and 2.x APIs.
#pragma once
#include <torch/torch.h>

#include "spes/io/config.h"

namespace spes {

torch::Device select_device(const Config& cfg);
// True when the config asks for (or "auto" implies) bf16 autocast on this device.
bool use_bf16_autocast(const Config& cfg, const torch::Device& device);
// Sets the intra-op thread count (cfg.threads, or every core when 0).
void configure_threads(const Config& cfg);

class AutocastScope {
 public:
  explicit AutocastScope(bool enabled);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool enabled_;
};

}  // namespace spes
