// AdamW's two moments of one trainable tensor, stored as optimizer.moment_dtype says, and the
// AdamW update of the low-precision forms (train/optimizer.h runs the fp32 form itself: its CPU
// pass and torch's fused CUDA kernel, which takes fp32 moments only).
//   fp32  4 + 4 bytes per value.
//   bf16  2 + 2 bytes per value; the fp32 result of each update is rounded stochastically to
//         bf16 (unbiased: a change smaller than half a bf16 step, 0.2%, still moves the moment
//         in expectation, where rounding to nearest would drop it).
//   int8  1 + 1 byte per value + one fp32 scale per block of kMomentBlock (256) consecutive
//         values (2.03 bytes in all): each value is stored relative to its block's largest
//         magnitude (absmax) as an 8-bit logarithmic code, levels 2^(1/8) apart (a "dynamic"
//         code as bitsandbytes' 8-bit optimizers use, logarithmic here so that the relative
//         precision is the same across the range): the first moment signed (sign + 127 levels
//         down to 2^-15.75 of the absmax, and 0), the second unsigned (255 levels down to
//         2^-31.75: it spans the square of the gradients' range, and its square root the same
//         range as the first moment). A linear code would round the small second moments of
//         a block to 0 and blow up their updates; rounding to the nearest of levels 2^(1/8)
//         apart would freeze a moment whose EMA moves by less than 4.4% a step (most of them:
//         beta2 = 0.95 moves it by 5% of the difference), so values are rounded stochastically
//         between the two levels around them (unbiased). A second moment stored as 0 means no
//         gradient so far: its first moment is taken as 0 too (they can only disagree by
//         rounding, and m / eps would be a huge step).
// The random bits of stochastic rounding come from a hash of (element index, seed), the seed from
// (optimizer step, tensor): the same bits on CPU and GPU, and a resumed run repeats them.
// Updates run over chunks of kMomentChunk values in ATen operations (CPU or CUDA), so their
// temporaries stay small whatever the tensor.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "spes/io/config.h"
#include "spes/io/safetensors.h"
#include "spes/model/memory_estimate.h"  // kMomentBlock, moment_bytes: the formats' sizes

namespace spes {

constexpr int64_t kMomentChunk = int64_t{1} << 22;  // values per update pass (blocks aligned)

// The int8 codes (documented above) of fp32 values `x` (1-D, numel a multiple of kMomentBlock)
// with one absmax per block: signed (first moment) or unsigned (second; x >= 0). `bits` holds
// 16 random bits per value (int64, 0..65535) for the stochastic rounding. Returns {codes (int8,
// or uint8 when unsigned), absmax (fp32 [numel / kMomentBlock])}.
std::pair<torch::Tensor, torch::Tensor> quantize_moment(const torch::Tensor& x,
                                                        const torch::Tensor& bits, bool is_signed);
// fp32 values of codes (1-D, numel a multiple of kMomentBlock) and their blocks' absmax.
torch::Tensor dequantize_moment(const torch::Tensor& codes, const torch::Tensor& absmax);
// 32 random bits per index lo .. lo+n-1 for `seed` (int64 tensor on `device`): the same bits on
// every device.
torch::Tensor moment_rounding_bits(int64_t lo, int64_t n, uint32_t seed,
                                   const torch::Device& device);
// fp32 `x` rounded stochastically to bf16 with 16 random bits per value (int64, 0..65535).
torch::Tensor round_bf16_stochastic(const torch::Tensor& x, const torch::Tensor& bits);

class AdamWMoments {
 public:
  // Zero moments for a tensor like `param` (its numel and device).
  AdamWMoments(const torch::Tensor& param, MomentDtype dtype);
  MomentDtype dtype() const { return dtype_; }
  // fp32 only: the moment tensors (param's shape), updated in place by optimizer.cpp.
  torch::Tensor& exp_avg() { return m_; }
  const torch::Tensor& exp_avg() const { return m_; }
  torch::Tensor& exp_avg_sq() { return v_; }

  struct Hyper {
    double lr, weight_decay, beta1, beta2, eps;
    double bias1, bias2;  // 1 - beta^t of this tensor's step t
    uint32_t seed;        // stochastic rounding
  };
  // bf16 / int8: one AdamW update of fp32 `param` with gradient `grad` x `grad_scale` (a 0-d
  // fp32 tensor on param's device: the clipping factor), storing the new moments. `skip`
  // (0-d bool on the device, or undefined) leaves param and moments as they were when true.
  void update(const torch::Tensor& param, const torch::Tensor& grad,
              const torch::Tensor& grad_scale, const Hyper& h, const torch::Tensor& skip);

  int64_t bytes() const;
  // Both moments as fp32 values of the parameter's shape on the CPU (a copy; bf16 and int8
  // decoded): what a node hands over with an expert (train/trainer.h, expert_moments).
  std::pair<torch::Tensor, torch::Tensor> fp32_values() const;
  // Checkpoint tensors: "exp_avg/<name>" and "exp_avg_sq/<name>" (param's shape: fp32, bf16,
  // or the int8/uint8 codes), and for int8 "exp_avg_absmax/<name>", "exp_avg_sq_absmax/<name>".
  void append_state(const std::string& name, NamedTensors* out) const;
  // Throws (naming `origin`) unless `by_name` holds this tensor's moments in any of those forms
  // (a checkpoint of any moment_dtype, fp32 ones of earlier versions included).
  void check_state(const std::unordered_map<std::string, const torch::Tensor*>& by_name,
                   const std::string& name, const std::string& origin) const;
  // Replaces the moments with the checkpoint's, converted to this dtype where they differ
  // (codes are copied as they are when both are int8; a conversion to int8 rounds with `seed`).
  void load_state(const std::unordered_map<std::string, const torch::Tensor*>& by_name,
                  const std::string& name, uint32_t seed);

 private:
  MomentDtype dtype_;
  int64_t numel_;
  std::vector<int64_t> sizes_;          // the parameter's shape
  torch::Tensor m_, v_;                // fp32 / bf16 (param's shape) or int8 / uint8 codes [numel]
  torch::Tensor m_absmax_, v_absmax_;  // int8: fp32 [blocks]
  // fp32 values of [lo, lo + n).
  std::pair<torch::Tensor, torch::Tensor> load(int64_t lo, int64_t n) const;
  void store(int64_t lo, const torch::Tensor& m, const torch::Tensor& v, uint32_t seed,
             const torch::Tensor& skip);
  void set_dense(const torch::Tensor& m, const torch::Tensor& v, uint32_t seed);
};

}  // namespace spes
