// The memory estimate (model/memory_estimate.h) against the tensors of a real training step,
// measured with MemoryMeter's counting CPU allocator: the weights the model holds, in the
// layout the trainer picks (fp32; under amp_bf16 fp32 masters of what trains, the bf16 expert
// stacks and frozen experts in bf16 only), then the gradients and AdamW moments a step adds
// (trainable tensors only). Activations are an estimate and are not compared here.
#include <gtest/gtest.h>

#include "tiny_model_config.h"
#include "spes/model/losses.h"
#include "spes/model/memory_estimate.h"
#include "spes/model/ownership.h"
#include "spes/model/param_counts.h"
#include "spes/model/registry.h"
#include "spes/model/runtime_layout.h"
#include "spes/model/transformer.h"
#include "spes/train/device.h"
#include "spes/train/memory_meter.h"
#include "spes/train/optimizer.h"

namespace {
using namespace spes;

// A SPES node of 2 (2 of 4 experts trained), shapes that allow the grouped expert layout.
Config measured_config(const std::string& precision) {
  Config cfg;
  cfg.model = spes::testing::tiny_model_config();  // d 16, 2 layers, 4 experts top-2, V 32
  cfg.model.set_ffn_hidden_size(16);               // a multiple of 8: grouped under amp_bf16
  cfg.spes_config.mode = "spes";
  cfg.spes_config.num_peers = 2;
  cfg.spes_config.transfer.dtype = "bf16";  // frozen experts may then be stored in bf16
  cfg.precision = precision;
  return cfg;
}

struct Measured {
  int64_t weights = 0;           // tensor bytes after building the model, less the RoPE tables
  int64_t step_increment = 0;    // what a first optimizer step adds and keeps
  int64_t frozen_bf16 = 0;       // frozen expert tensors stored in bf16
  int64_t frozen_total = 0;
};

Measured measure(const Config& cfg) {
  const torch::Device cpu(torch::kCPU);
  const bool bf16 = cfg.precision == "amp_bf16";
  MemoryMeter meter(cpu);
  const int64_t start = meter.current_bytes();
  const Ownership own = Ownership::from_config(cfg);
  Transformer model(cfg.model, cpu,
                    model_runtime_for(cfg, cpu, trainable_expert_table(cfg, own, 0)));
  model.init_weights(1);
  const int64_t rope = 2 * cfg.model.max_sequence_length * cfg.model.head_dim() * 4;
  Measured m;
  m.weights = meter.current_bytes() - start - rope;
  ParamRegistry registry(model, cfg, own, 0);
  for (const auto& e : registry.entries()) {
    if (e.trainable || e.role != ParamRole::Expert) continue;
    ++m.frozen_total;
    if (e.tensor.scalar_type() == torch::kBFloat16) ++m.frozen_bf16;
  }
  const int64_t before_step = meter.current_bytes();
  AdamW opt(registry.trainable(), cfg.optimizer);
  opt.use_persistent_grads();
  {
    torch::manual_seed(3);
    const torch::Tensor tokens = torch::randint(cfg.model.vocab_size, {2, 8}, torch::kInt64);
    const torch::Tensor targets = torch::roll(tokens, -1, 1);
    {
      AutocastScope ac(bf16, torch::kCPU);
      LossTerms t = compute_losses(model, tokens, targets);
      t.total.backward();
    }
    opt.step(1e-3, 1.0);
  }
  m.step_increment = meter.current_bytes() - before_step;
  return m;
}

void expect_estimate_matches(const std::string& precision) {
  SCOPED_TRACE(precision);
  const Config cfg = measured_config(precision);
  const ParamCounts counts = param_counts(cfg, 0);
  const NodeMemory f = node_memory(cfg, counts);
  const Measured m = measure(cfg);
  // Small tensors of the layout (slot maps, step counters) are allowed for; a frozen expert in
  // the wrong dtype or a gradient it should not have would be several times that.
  const int64_t slack = 1024;
  EXPECT_NEAR(m.weights, f.weights() - f.autocast_copies, slack);
  EXPECT_NEAR(m.step_increment, f.gradients + f.adam_moments, slack);
  EXPECT_GT(m.frozen_total, 0);
  if (precision == "amp_bf16") {
    EXPECT_EQ(m.frozen_bf16, m.frozen_total) << "frozen experts are stored in bf16";
    EXPECT_EQ(f.weights_by_dtype.at("fp32"), 4 * counts.trainable);
  } else {
    EXPECT_EQ(m.frozen_bf16, 0);
    EXPECT_EQ(f.weights_by_dtype.at("fp32"), 4 * counts.total);
  }
}

TEST(MemoryEstimate, ResidentBytesMatchAMeasuredStepInFp32) { expect_estimate_matches("fp32"); }

TEST(MemoryEstimate, ResidentBytesMatchAMeasuredStepInBf16WithFrozenExpertsInBf16) {
  expect_estimate_matches("amp_bf16");
}

}  // namespace
