// GPU checks (run by scripts/gpu_check.sh on the GPU machine; skipped with the reason where no
// GPU is visible): CUDA against CPU for each kernel path in fp32 (RMSNorm, attention, the
// grouped experts against the CPU per-expert kernel, the chunked LM-head loss, the fused AdamW
// step) and with bf16 operands; a training step on CUDA against the same step on CPU in fp32;
// a bf16 run (grouped experts, bf16 frozen experts, checkpointing) whose loss falls; and the
// measured memory of a step against torch's CUDA peak statistics.
#include <gtest/gtest.h>

#include <map>

#include "model/tiny_model_config.h"
#include "spes/model/layers.h"
#include "spes/model/losses.h"
#include "spes/train/device.h"
#include "spes/train/memory_meter.h"
#include "spes/train/optimizer.h"
#include "spes/model/registry.h"
#include "spes/train/trainer.h"
#include "train/train_test_util.h"

using namespace spes;
namespace fs = std::filesystem;

namespace {

#define SKIP_WITHOUT_GPU()                                                              \
  do {                                                                                  \
    if (!spes::cuda_available())                                                        \
      GTEST_SKIP() << "no CUDA GPU visible to libtorch (" << torch_build_summary()      \
                   << "): this GPU check runs on the GPU machine (scripts/gpu_check.sh)"; \
  } while (0)

const torch::Device kCuda(torch::kCUDA, 0);

double maxrel(const torch::Tensor& a, const torch::Tensor& b) {
  torch::Tensor x = a.detach().to(torch::kCPU, torch::kFloat64);
  torch::Tensor y = b.detach().to(torch::kCPU, torch::kFloat64);
  return ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item<double>();
}

// Values and input gradients of f on CPU and on CUDA for the same inputs (probe-weighted sum).
void expect_same_on_both(const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& f,
                         const std::vector<torch::Tensor>& inputs, double tol) {
  auto run = [&](const torch::Device& d) {
    std::vector<torch::Tensor> in;
    for (const auto& t : inputs) in.push_back(t.to(d).detach().requires_grad_(t.is_floating_point()));
    torch::Tensor y = f(in);
    torch::manual_seed(11);
    torch::Tensor probe = torch::randn(y.sizes()).to(d);
    (y.to(torch::kFloat32) * probe).sum().backward();
    std::vector<torch::Tensor> out = {y.detach()};
    for (const auto& t : in) out.push_back(t.is_floating_point() ? t.grad() : torch::Tensor());
    return out;
  };
  auto cpu = run(torch::kCPU), gpu = run(kCuda);
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (!cpu[i].defined()) continue;
    EXPECT_LT(maxrel(gpu[i], cpu[i]), tol) << "output " << i;
  }
}

ModelConfig gpu_tiny() {
  ModelConfig m = spes::testing::tiny_model_config();
  m.d_model = 64;
  m.n_heads = 4;
  m.mlp_hidden_size = 64;
  m.vocab_size = 256;
  m.max_sequence_length = 32;
  return m;
}

Config trainer_config(const std::string& shard, int64_t steps, const std::string& device) {
  Config c;
  c.model = gpu_tiny();
  c.data.paths = {shard};
  c.data.validation_fraction = 0.1;
  c.max_duration = std::to_string(steps);
  c.optimizer.learning_rate = 3e-3;
  c.scheduler.t_warmup = 2;
  c.scheduler.t_max = steps;
  c.global_train_batch_size = 8;
  c.device_train_microbatch_size = 4;
  c.eval_interval = 0;
  c.eval_batches = 2;
  c.threads = 2;
  c.device = device;
  config_validate(c, "cuda test");
  return c;
}

TrainerOptions quiet() {
  TrainerOptions o;
  o.progress = ProgressMode::None;
  o.resume_from = "";
  return o;
}

}  // namespace

TEST(CudaKernels, RmsNormMatchesCpu) {
  SKIP_WITHOUT_GPU();
  torch::manual_seed(1);
  expect_same_on_both([](const auto& in) { return rms_norm(in[0], in[1], 1e-6); },
                      {torch::randn({7, 64}), torch::randn({64})}, 1e-5);
}

TEST(CudaKernels, AttentionSublayerMatchesCpu) {
  SKIP_WITHOUT_GPU();
  ModelConfig m = gpu_tiny();
  torch::manual_seed(2);
  const int64_t D = m.d_model;
  auto tables = rope_tables(m.max_sequence_length, m.head_dim(), m.rope_theta, torch::kCPU);
  expect_same_on_both(
      [&](const auto& in) {
        BlockWeights b;
        b.q = in[1];
        b.k = in[2];
        b.v = in[3];
        b.o = in[4];
        b.q_norm = in[5];
        b.k_norm = in[6];
        return attention_forward(b, in[0], m, tables.first.to(in[0].device()),
                                 tables.second.to(in[0].device()));
      },
      {torch::randn({2, 16, D}), torch::randn({D, D}) * 0.1, torch::randn({D, D}) * 0.1,
       torch::randn({D, D}) * 0.1, torch::randn({D, D}) * 0.1, torch::rand({D}) + 0.5,
       torch::rand({D}) + 0.5},
      1e-4);
}

TEST(CudaKernels, GroupedExpertsMatchCpuPerExpertKernel) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 40, D = 64, F = 64, E = 4;
  torch::manual_seed(3);
  torch::Tensor x = torch::randn({N, D}), router = torch::randn({E, D}) * 0.5;
  std::vector<ExpertWeights> cpu(E);
  for (auto& e : cpu)
    e = {torch::randn({F, D}) * 0.2, torch::randn({F, D}) * 0.2, torch::randn({D, F}) * 0.2};
  for (torch::ScalarType dt : {torch::kFloat32, torch::kBFloat16}) {
    std::vector<ExpertWeights> gpu(E);
    ExpertStack stack = expert_stack_create(gpu, {true, true, false, false}, D, F, dt,
                                            dt == torch::kBFloat16 ? torch::kBFloat16
                                                                   : torch::kFloat32,
                                            kCuda);
    {
      torch::NoGradGuard ng;
      for (int64_t e = 0; e < E; ++e) {
        gpu[e].w1.copy_(cpu[e].w1);
        gpu[e].v1.copy_(cpu[e].v1);
        gpu[e].w2.copy_(cpu[e].w2);
      }
    }
    for (int64_t e = 0; e < 2; ++e)
      for (auto* t : {&gpu[e].w1, &gpu[e].v1, &gpu[e].w2}) t->set_requires_grad(true);
    torch::Tensor xr = x.clone().requires_grad_(true), xg = x.to(kCuda).requires_grad_(true);
    std::vector<ExpertWeights> ref = cpu;
    for (auto& e : ref)
      for (auto* t : {&e.w1, &e.v1, &e.w2}) *t = t->detach().clone().requires_grad_(true);
    // bf16 router logits could flip a near tie in the top-k: there every token goes to every
    // expert (continuous in the weights), in fp32 to the top 2.
    const int64_t k = dt == torch::kFloat32 ? 2 : E;
    torch::Tensor yr = moe_forward(xr, router, ref, k, false, nullptr);
    torch::Tensor yg = moe_forward_grouped(xg, router.to(kCuda), gpu, stack, k, false, nullptr);
    const double tol = dt == torch::kFloat32 ? 1e-4 : 3e-2;
    EXPECT_LT(maxrel(yg, yr), tol) << c10::toString(dt);
    torch::Tensor probe = torch::randn({N, D});
    (yr * probe).sum().backward();
    (yg * probe.to(kCuda)).sum().backward();
    EXPECT_LT(maxrel(xg.grad(), xr.grad()), tol) << c10::toString(dt);
    for (int64_t e = 0; e < 2; ++e) {
      EXPECT_LT(maxrel(gpu[e].w1.grad(), ref[e].w1.grad()), tol) << e;
      EXPECT_LT(maxrel(gpu[e].w2.grad(), ref[e].w2.grad()), tol) << e;
    }
    EXPECT_FALSE(gpu[2].w1.grad().defined());  // frozen: no weight gradient
  }
}

TEST(CudaKernels, ChunkedLmHeadLossMatchesCpu) {
  SKIP_WITHOUT_GPU();
  torch::manual_seed(4);
  torch::Tensor targets = torch::randint(0, 300, {50});
  targets[3] = -1;
  expect_same_on_both(
      [&](const auto& in) {
        return lm_head_losses_chunked(in[0], in[1], targets.to(in[0].device()), 1e-2, 16).total;
      },
      {torch::randn({50, 64}), torch::randn({300, 64}) * 0.2}, 1e-5);
  // bf16 operands under autocast, with the head padded to 320 rows for aligned products: values
  // and gradients close to fp32's (unpadded).
  torch::Tensor h = torch::randn({50, 64}).to(kCuda), w = (torch::randn({300, 64}) * 0.2).to(kCuda);
  torch::Tensor hb = h.clone().requires_grad_(true), wb = w.clone().requires_grad_(true);
  torch::Tensor hf = h.clone().requires_grad_(true), wf = w.clone().requires_grad_(true);
  LmHeadLoss r;
  {
    AutocastScope ac(true, torch::kCUDA);
    EXPECT_EQ(lm_head_vocab_multiple(hb, wb), 64);
    r = lm_head_losses_chunked(hb, wb, targets.to(kCuda), 1e-2, 16);
  }
  EXPECT_EQ(lm_head_vocab_multiple(hf, wf), 1);  // fp32: no converted copy, no padding
  LmHeadLoss f = lm_head_losses_chunked(hf, wf, targets.to(kCuda), 1e-2);
  EXPECT_LT(maxrel(r.ce, f.ce), 2e-2);
  r.total.backward();
  f.total.backward();
  EXPECT_EQ(wb.grad().sizes(), wb.sizes());
  EXPECT_LT(maxrel(hb.grad(), hf.grad()), 3e-2);
  EXPECT_LT(maxrel(wb.grad(), wf.grad()), 3e-2);
}

TEST(CudaKernels, FusedAdamWStepMatchesCpu) {
  SKIP_WITHOUT_GPU();
  torch::manual_seed(5);
  auto make = [](const torch::Device& d) {
    std::vector<RegistryEntry> ps;
    for (int i = 0; i < 3; ++i) {
      RegistryEntry e;
      e.name = "p" + std::to_string(i);
      torch::manual_seed(10 + i);
      e.tensor = torch::randn({17, 5 + i}).to(d).requires_grad_(true);
      ps.push_back(e);
    }
    return ps;
  };
  OptimizerConfig oc;
  auto pc = make(torch::kCPU), pg = make(kCuda);
  AdamW oc_cpu(pc, oc), oc_gpu(pg, oc);
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < pc.size(); ++i) {
      torch::manual_seed(100 * step + i);
      torch::Tensor g = torch::randn(pc[i].tensor.sizes()) * 3.0;  // clipped at norm 1
      pc[i].tensor.mutable_grad() = g;
      pg[i].tensor.mutable_grad() = g.to(kCuda);
    }
    const double nc = oc_cpu.step(1e-2, 1.0), ng = oc_gpu.step(1e-2, 1.0);
    EXPECT_NEAR(ng, nc, 1e-5 * nc);
  }
  for (size_t i = 0; i < pc.size(); ++i) EXPECT_LT(maxrel(pg[i].tensor, pc[i].tensor), 1e-6);
}

// bf16 and int8 moments (train/adamw_moments.h): the same ATen update and the same rounding bits
// on both devices, so the same parameters and (but for a rare rounding decision that float
// differences flip) the same stored codes; the skip flag of a non-finite norm keeps everything.
TEST(CudaKernels, LowPrecisionMomentsMatchCpu) {
  SKIP_WITHOUT_GPU();
  for (MomentDtype md : {MomentDtype::Bf16, MomentDtype::Int8}) {
    auto make = [](const torch::Device& d) {
      std::vector<RegistryEntry> ps;
      for (int i = 0; i < 2; ++i) {
        RegistryEntry e;
        e.name = "p" + std::to_string(i);
        torch::manual_seed(20 + i);
        e.tensor = torch::randn({i == 0 ? 300 : 7, 70}).to(d).requires_grad_(true);
        ps.push_back(e);
      }
      return ps;
    };
    OptimizerConfig oc;
    oc.moment_dtype = md;
    auto pc = make(torch::kCPU), pg = make(kCuda);
    AdamW cpu(pc, oc), gpu(pg, oc);
    for (int step = 0; step < 4; ++step) {
      for (size_t i = 0; i < pc.size(); ++i) {
        torch::manual_seed(100 * step + i);
        torch::Tensor g = torch::randn(pc[i].tensor.sizes()) * 3.0;
        if (step == 3 && i == 1) g[0][0] = NAN;  // a non-finite norm: the GPU skips the update
        pc[i].tensor.mutable_grad() = g;
        pg[i].tensor.mutable_grad() = g.to(kCuda);
      }
      if (step == 3) {
        const NamedTensors before = gpu.state_tensors();
        std::vector<torch::Tensor> params;
        for (const auto& e : pg) params.push_back(e.tensor.detach().clone());
        EXPECT_THROW(gpu.step(1e-2, 1.0), Error);
        const NamedTensors after = gpu.state_tensors();
        for (size_t i = 0; i < before.size(); ++i)  // the moments (step counts do advance)
          if (before[i].first.rfind("step/", 0) != 0)
            EXPECT_TRUE(torch::equal(before[i].second, after[i].second)) << before[i].first;
        for (size_t i = 0; i < pg.size(); ++i) EXPECT_TRUE(torch::equal(params[i], pg[i].tensor));
        break;
      }
      const double nc = cpu.step(1e-2, 1.0), ng = gpu.step(1e-2, 1.0);
      EXPECT_NEAR(ng, nc, 1e-5 * nc);
    }
    for (size_t i = 0; i < pc.size(); ++i) EXPECT_LT(maxrel(pg[i].tensor, pc[i].tensor), 1e-4);
    const NamedTensors sc = cpu.state_tensors(), sg = gpu.state_tensors();
    for (size_t i = 0; i < sc.size(); ++i) {
      const torch::Tensor same = sc[i].second.eq(sg[i].second.to(torch::kCPU));
      EXPECT_GT(same.to(torch::kFloat64).mean().item<double>(), 0.99) << sc[i].first;
    }
  }
}

TEST(CudaTraining, Fp32StepsMatchCpu) {
  SKIP_WITHOUT_GPU();
  const fs::path dir = fs::temp_directory_path() / ("spes_cuda_fp32_" + std::to_string(getpid()));
  const std::string shard = spes::test::make_pattern_shard(dir / "data", 20000, 256);
  std::vector<nlohmann::json> m[2];
  int k = 0;
  for (const char* dev : {"cpu", "cuda"}) {
    Config c = trainer_config(shard, 4, dev);
    c.precision = "fp32";
    Trainer t(c, (dir / dev).string(), quiet());
    t.run();
    m[k++] = spes::test::read_metrics(dir / dev);
  }
  ASSERT_EQ(m[0].size(), 4u);
  ASSERT_EQ(m[1].size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_NEAR(m[1][i]["loss"].get<double>(), m[0][i]["loss"].get<double>(), 1e-4) << i;
    EXPECT_NEAR(m[1][i]["grad_norm"].get<double>(), m[0][i]["grad_norm"].get<double>(),
                1e-3 * m[0][i]["grad_norm"].get<double>()) << i;
  }
  EXPECT_TRUE(m[1].front().contains("gpu_peak_allocated_mb"));
  fs::remove_all(dir);
}

// Two trainers with the same config and data take the same amp_bf16 steps on the GPU bit for
// bit (losses, weights): what the bit-for-bit checks of an ownership change on the GPU
// (CudaLayouts/OwnershipChange.*) rest on.
TEST(CudaTraining, TwoIdenticalBf16RunsAreBitIdentical) {
  SKIP_WITHOUT_GPU();
  const fs::path dir = fs::temp_directory_path() / ("spes_cuda_det_" + std::to_string(getpid()));
  const std::string shard = spes::test::make_pattern_shard(dir / "data", 20000, 256);
  Config c = trainer_config(shard, 6, "cuda");
  c.precision = "amp_bf16";
  c.frozen_experts = {"*:3"};
  Trainer a(c, (dir / "a").string(), quiet()), b(c, (dir / "b").string(), quiet());
  for (int i = 0; i < 6; ++i) {
    const auto ra = a.train_step(), rb = b.train_step();
    EXPECT_EQ(ra["loss"].get<double>(), rb["loss"].get<double>()) << "step " << i;
  }
  for (size_t i = 0; i < a.registry().entries().size(); ++i) {
    const auto& ea = a.registry().entries()[i];
    EXPECT_TRUE(torch::equal(ea.tensor, b.registry().entries()[i].tensor)) << ea.name;
  }
  fs::remove_all(dir);
}

TEST(CudaTraining, Bf16RunWithFrozenExpertsAndCheckpointingLearns) {
  SKIP_WITHOUT_GPU();
  const fs::path dir = fs::temp_directory_path() / ("spes_cuda_bf16_" + std::to_string(getpid()));
  const std::string shard = spes::test::make_pattern_shard(dir / "data", 40000, 256);
  Config c = trainer_config(shard, 40, "cuda");
  c.precision = "amp_bf16";
  c.activation_checkpointing = "whole_layer";
  c.frozen_experts = {"*:2", "*:3"};
  Trainer t(c, (dir / "run").string(), quiet());
  for (const auto& e : t.registry().entries())
    if (!e.trainable) EXPECT_EQ(e.tensor.scalar_type(), torch::kBFloat16) << e.name;
  t.run();
  auto m = spes::test::read_metrics(dir / "run");
  ASSERT_EQ(m.size(), 40u);
  EXPECT_LT(m.back()["ce"].get<double>(), m.front()["ce"].get<double>() - 1.0);
  fs::remove_all(dir);
}

TEST(CudaMemory, MeterAgreesWithTorchPeakStatistics) {
  SKIP_WITHOUT_GPU();
  MemoryMeter meter(kCuda);
  const int64_t base = meter.current_bytes();
  {
    torch::Tensor a = torch::empty({64, 1024, 1024}, torch::TensorOptions().device(kCuda));
    EXPECT_GE(meter.current_bytes() - base, a.nbytes());
  }
  EXPECT_GE(meter.peak_bytes() - base, int64_t{64} << 22);
  EXPECT_EQ(gpu_memory_stats(kCuda).peak_allocated, meter.peak_bytes());
}

// A meter made first thing in a process, before any CUDA tensor: train_bench with
// --peak-tflops made one so, and the caching allocator, not yet initialised, refused ("Invalid
// device argument"). The death test's "threadsafe" style runs the block in a fresh process (this
// binary again, only this test, nothing on the GPU before the meter).
TEST(CudaMemory, MeterWorksFirstThingInAFreshProcess) {
  SKIP_WITHOUT_GPU();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        MemoryMeter meter(kCuda);
        torch::Tensor a = torch::empty({1 << 20}, torch::TensorOptions().device(kCuda));
        std::exit(meter.peak_bytes() >= a.nbytes() && gpu_memory_stats(kCuda).allocated > 0
                      ? 0 : 3);
      },
      ::testing::ExitedWithCode(0), "");
}
