// Training throughput benchmark: for one model shape, times full optimizer steps (forward,
// backward, clipping, AdamW) on random tokens, each queued before the previous one's gradient
// norm is read (as the trainer does: no host synchronisation inside a step; --sync-check counts
// any on a GPU), and reports tokens/s, model FLOPs per token
// (6 x active matrix parameters incl. the LM head, excl. the embedding lookup, + 12 x layers x
// seq x d_model for attention; frozen experts count 4 instead of 6, as they compute no weight
// gradient, weighted by the share of experts frozen, i.e. assuming balanced routing), the
// matrix-product peak measured in the same process (fp32 GEMMs on CPU; bf16 or fp32 products
// on a GPU, or --peak-tflops), MFU = achieved / peak, and peak memory (RSS; on a GPU also the
// caching allocator's peak tensor bytes). --device and --precision choose where and how (the
// trainer's layouts: grouped experts and bf16 frozen experts under amp_bf16, see
// train/device.h). --profile adds a profile of one more step (bench/step_profile.h: chrome trace,
// top kernels). Prints one JSON line. Run one shape per process so that peak memory belongs
// to that shape (bench/run_train_bench.sh, scripts/gpu_check.sh).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <sys/resource.h>

#include <chrono>
#include <iostream>

#include "spes/common/cpu_blas.h"
#include "spes/common/memory_policy.h"
#include "spes/common/sysinfo.h"
#include "spes/io/config.h"
#include "spes/model/losses.h"
#include "spes/model/registry.h"
#include "spes/train/cuda_library.h"
#include "spes/train/cuda_sync_check.h"
#include "spes/train/device.h"
#include "spes/train/memory_meter.h"
#include "spes/train/micro_batch_workers.h"
#include "spes/train/optimizer.h"
#include "spes/train/step_figures.h"
#include "step_profile.h"

using Clock = std::chrono::steady_clock;
using spes::StepFigures;

static double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// CPU seconds (user + system, all threads) used by this process so far.
static double cpu_seconds() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec * 1e-6; };
  return s(ru.ru_utime) + s(ru.ru_stime);
}

// Best sustained fp32 GEMM rate of square n x n products, in FLOP/s; *per_cpu_s gets the rate
// per CPU second of that best repetition (what the products get from the CPU time they use,
// which other processes on the machine disturb much less than the wall-clock rate).
static double measure_gemm_peak(int64_t n, int reps, double* per_cpu_s) {
  torch::NoGradGuard ng;
  torch::Tensor a = torch::randn({n, n}), b = torch::randn({n, n}), c = torch::empty({n, n});
  for (int i = 0; i < 2; ++i) torch::mm_out(c, a, b);
  double best = 0, best_cpu = 0;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    const double c0 = cpu_seconds();
    for (int i = 0; i < 4; ++i) torch::mm_out(c, a, b);
    const double flops = 4 * 2.0 * n * n * n;
    best = std::max(best, flops / seconds_since(t0));
    best_cpu = std::max(best_cpu, flops / (cpu_seconds() - c0));
  }
  *per_cpu_s = best_cpu;
  return best;
}

// Best sustained rate of square n x n products of `dtype` on a GPU, in FLOP/s.
static double measure_gpu_matmul_peak(const torch::Device& dev, torch::ScalarType dtype,
                                      int64_t n, int reps) {
  torch::NoGradGuard ng;
  auto o = torch::TensorOptions().dtype(dtype).device(dev);
  torch::Tensor a = torch::randn({n, n}, o), b = torch::randn({n, n}, o), c = torch::empty({n, n}, o);
  for (int i = 0; i < 3; ++i) torch::mm_out(c, a, b);
  torch::cuda::synchronize();
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    for (int i = 0; i < 10; ++i) torch::mm_out(c, a, b);
    torch::cuda::synchronize();
    best = std::max(best, 10 * 2.0 * n * n * n / seconds_since(t0));
  }
  return best;
}

// frozen_share: fraction of each layer's experts that are frozen (4 FLOPs per parameter and
// token instead of 6: no weight gradient), under balanced routing.
static double flops_per_token(const spes::ModelConfig& m, double frozen_share) {
  const double D = m.d_model, F = m.ffn_hidden_size(), kv = m.kv_heads() * m.head_dim();
  double shared = D * D * 2 + D * kv * 2;  // q, o, k, v
  double expert = 0;
  if (m.is_moe()) {
    shared += m.moe_num_experts * D;
    expert = m.moe_top_k * 3 * D * F;
  } else {
    shared += 3 * D * F;
  }
  const double per_layer = 6 * shared + expert * (6 * (1 - frozen_share) + 4 * frozen_share);
  return m.n_layers * per_layer + 6.0 * m.vocab_size * D +  // + LM head
         12.0 * m.n_layers * m.max_sequence_length * D;
}

int main(int argc, char** argv) {
  spes::keep_freed_heap_memory();     // as the spes binary does (common/memory_policy.h)
  spes::select_cpu_blas_core();       // as the spes binary does (common/cpu_blas.h)
  spes::load_torch_cuda_if_driver();  // before any torch call (train/cuda_library.h)
  CLI::App app{"spes training throughput benchmark"};
  spes::Config cfg;
  cfg.model.d_model = 512;
  cfg.model.n_layers = 8;
  cfg.model.n_heads = 8;
  cfg.model.moe_num_experts = 8;
  cfg.model.moe_top_k = 2;
  int64_t hidden = 1024;  // F, each expert's hidden size (model.mlp_hidden_size = 2F)
  cfg.model.vocab_size = 8192;
  cfg.model.max_sequence_length = 256;
  int64_t batch = 8, steps = 5, warmup = 2, threads = 0, micro_batch = -1;
  double frozen_fraction = 0, peak_tflops = 0;
  std::string profile;
  std::string name = "d512";
  bool fast_init = false, sync_check = false;
  app.add_option("--name", name, "Label of this shape in the output");
  app.add_option("--d-model", cfg.model.d_model);
  app.add_option("--layers", cfg.model.n_layers);
  app.add_option("--heads", cfg.model.n_heads);
  app.add_option("--experts", cfg.model.moe_num_experts);
  app.add_option("--top-k", cfg.model.moe_top_k);
  app.add_option("--hidden", hidden, "Expert hidden size F");
  app.add_option("--vocab", cfg.model.vocab_size);
  app.add_option("--seq", cfg.model.max_sequence_length);
  app.add_option("--batch", batch, "Sequences per step");
  app.add_option("--steps", steps, "Timed steps");
  app.add_option("--warmup", warmup, "Untimed steps first");
  app.add_option("--threads", threads, "Intra-op threads (0: all cores)");
  app.add_option("--micro-batch", micro_batch,
                 "Sequences per forward/backward; the batch's micro-batches run one per thread "
                 "at once, as the trainer does (-1: batch / threads; 0: the whole batch in one "
                 "pass, every kernel split over the threads)");
  app.add_option("--frozen-fraction", frozen_fraction,
                 "Fraction of each layer's experts frozen (e.g. 0.75 = a SPES node of 4)");
  app.add_option("--profile", profile,
                 "Profile one extra step (after the timed ones): its chrome trace to this file "
                 "(CPU operators, and the CUDA kernel timeline on a GPU) and a table of the top "
                 "kernels or operators in the output (\"profile\")");
  app.add_option("--device", cfg.device, "auto, cpu, cuda or cuda:N");
  app.add_option("--precision", cfg.precision, "fp32, amp_bf16 or auto (bf16 on a GPU)");
  app.add_option("--moment-dtype", cfg.optimizer.moment_dtype,
                 "AdamW moments: fp32, bf16 or int8 (train/adamw_moments.h)");
  app.add_option("--activation-checkpointing", cfg.activation_checkpointing,
                 "none, whole_layer, one_in_two, ...");
  app.add_option("--peak-tflops", peak_tflops,
                 "Matrix-product peak to divide by, in TFLOP/s (0: measure it here)");
  app.add_flag("--fast-init", fast_init,
               "Fill weights with N(0, 0.02) on the device instead of the truncated-normal init on "
               "the CPU (large models: the step's speed does not depend on it)");
  app.add_flag("--sync-check", sync_check,
               "On a GPU: count the host synchronisations of the timed steps (c10's sync debug "
               "mode) and report them per step (\"host_syncs_per_step\"; 0 expected)");
  CLI11_PARSE(app, argc, argv);
  cfg.model.set_ffn_hidden_size(hidden);

  at::set_num_threads(threads > 0 ? static_cast<int>(threads) : spes::cpu_cores());
  const torch::Device dev = spes::select_device(cfg);
  const bool bf16 = spes::use_bf16_autocast(cfg, dev);
  const int64_t E = cfg.model.moe_num_experts;
  const int64_t n_frozen = static_cast<int64_t>(frozen_fraction * E + 0.5);
  for (int64_t e = E - n_frozen; e < E; ++e) cfg.frozen_experts.push_back("*:" + std::to_string(e));
  config_validate(cfg, "bench");

  double peak_per_cpu_s = 0, peak = peak_tflops * 1e12;
  if (peak <= 0)
    peak = dev.is_cuda() ? measure_gpu_matmul_peak(dev, bf16 ? torch::kBFloat16 : torch::kFloat32,
                                                   8192, 5)
                         : measure_gemm_peak(1024, 5, &peak_per_cpu_s);
  std::unique_ptr<spes::MemoryMeter> gpu_meter;  // the peak from here on (not the peak products)
  if (dev.is_cuda()) gpu_meter = std::make_unique<spes::MemoryMeter>(dev);
  const spes::Ownership own = spes::Ownership::from_config(cfg);
  spes::Transformer model(cfg.model, dev,
                          spes::model_runtime_for(cfg, dev, spes::trainable_expert_table(cfg, own, 0)));
  if (fast_init) {
    torch::NoGradGuard ng;
    for (const auto& p : model.params())
      if (p.tensor.dim() == 1) p.tensor.fill_(1.0);
      else p.tensor.normal_(0.0, cfg.model.init_std);
  } else {
    model.init_weights(1);
  }
  spes::ParamRegistry reg(model, cfg, own, 0);
  int64_t measured_state_bytes = -1;  // the moments as the CPU memory meter sees them
  std::unique_ptr<spes::MemoryMeter> cpu_meter;
  if (!dev.is_cuda()) cpu_meter = std::make_unique<spes::MemoryMeter>(dev);
  const int64_t before_optimizer = cpu_meter ? cpu_meter->current_bytes() : 0;
  spes::AdamW opt(reg.trainable(), cfg.optimizer);
  if (cpu_meter) {
    measured_state_bytes = cpu_meter->current_bytes() - before_optimizer;
    cpu_meter.reset();
  }
  opt.use_persistent_grads();  // as the trainer does
  if (micro_batch < 0) micro_batch = !dev.is_cuda() && batch % at::get_num_threads() == 0
                                         ? batch / at::get_num_threads() : batch;
  if (micro_batch == 0) micro_batch = batch;
  if (batch % micro_batch != 0) {
    std::cerr << "--micro-batch " << micro_batch << " does not divide --batch " << batch << "\n";
    return 2;
  }
  const int64_t micro_batches = batch / micro_batch;
  spes::MicroBatchWorkers workers(
      model, reg.trainable(), spes::MicroBatchWorkers::workers_for(micro_batches, dev));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const int64_t T = cfg.model.max_sequence_length;
  // A step's figures (the gradient norm) are read after the next step is queued, as the
  // trainer does (train/trainer.h): on a GPU a step never waits for the device.
  StepFigures in_flight;
  int64_t in_flight_step = 0;
  auto read_figures = [&] {
    if (in_flight.defined())
      spes::AdamW::check_norm(in_flight.values()[0].item<double>(), in_flight_step);
    in_flight = StepFigures();
  };
  auto run_step = [&] {  // what Trainer::queue_step does, without data loading and logging
    torch::Tensor tokens = at::randint(cfg.model.vocab_size, {batch, T}, gen, torch::kInt64);
    torch::Tensor targets = torch::roll(tokens, -1, 1);
    if (dev.is_cuda()) {  // as the trainer: from pinned memory, without waiting for the device
      tokens = tokens.pin_memory().to(dev, /*non_blocking=*/true);
      targets = targets.pin_memory().to(dev, /*non_blocking=*/true);
    }
    workers.run(micro_batches, [&](const spes::Transformer& m, int64_t i) {
      spes::LossTerms l;
      {
        spes::AutocastScope ac(bf16, dev.type());
        l = spes::compute_losses(m, tokens.narrow(0, i * micro_batch, micro_batch),
                                 targets.narrow(0, i * micro_batch, micro_batch));
      }
      (l.total / static_cast<double>(micro_batches)).backward();
    });
    StepFigures figures(opt.step_queued(1e-4, 1.0));
    opt.zero_grad();
    read_figures();  // the previous step's
    in_flight = figures;
    in_flight_step = opt.step_count();
  };
  for (int64_t i = 0; i < warmup; ++i) run_step();
  read_figures();
  if (dev.is_cuda()) torch::cuda::synchronize();
  auto t0 = Clock::now();
  const double c0 = cpu_seconds();
  int64_t host_syncs = -1;
  {
    // --sync-check: c10 counts every host synchronisation of the timed steps (CUDA only).
    std::unique_ptr<spes::CudaSyncCounter> syncs;
    if (sync_check && dev.is_cuda()) syncs = std::make_unique<spes::CudaSyncCounter>();
    for (int64_t i = 0; i < steps; ++i) run_step();
    if (syncs) host_syncs = syncs->count();
  }
  read_figures();
  if (dev.is_cuda()) torch::cuda::synchronize();
  const double secs = seconds_since(t0) / steps;
  const double cpu_secs = (cpu_seconds() - c0) / steps;
  const double tok_s = batch * T / secs;
  nlohmann::json profile_summary;
  if (!profile.empty())
    profile_summary = spes::bench::profile_step([&] { run_step(), read_figures(); },
                                                dev.is_cuda(), profile);
  const double fpt = flops_per_token(cfg.model, static_cast<double>(n_frozen) / std::max<int64_t>(1, E));
  int64_t weight_bytes = 0;
  for (const auto& p : model.params()) weight_bytes += p.tensor.nbytes();
  nlohmann::json out = {
      {"name", name}, {"device", dev.str()}, {"precision", bf16 ? "amp_bf16" : "fp32"},
      {"activation_checkpointing", cfg.activation_checkpointing.name()},
      {"threads", at::get_num_threads()}, {"params", model.num_params()},
      {"weight_bytes", weight_bytes},
      {"trainable_params", reg.trainable_numel()}, {"frozen_experts_per_layer", n_frozen},
      {"tokens_per_step", batch * T}, {"micro_batch", micro_batch},
      {"parallel_micro_batches", workers.workers()}, {"step_s", secs}, {"tokens_per_s", tok_s},
      {"flops_per_token", fpt}, {"achieved_gflops", tok_s * fpt / 1e9},
      {"gemm_peak_gflops", peak / 1e9}, {"cpu_gemm", spes::cpu_blas_summary()},
      {"cpu_blas_core", spes::openblas_core()},
      {"mfu", tok_s * fpt / peak},
      {"peak_source", peak_tflops > 0 ? "given" : dev.is_cuda() ? (bf16 ? "bf16 8192^3" : "fp32 8192^3") : "fp32 1024^3"},
      // The same ratio in CPU time (FLOPs per CPU second of the steps over those of the GEMM
      // peak): less sensitive to a loaded machine; spin-waiting threads count as used time.
      {"step_cpu_s", cpu_secs},
      {"moment_dtype", cfg.optimizer.moment_dtype.name()},
      {"optimizer_state_bytes", opt.state_bytes()},
      {"optimizer_state_bytes_per_trainable_param",
       static_cast<double>(opt.state_bytes()) / std::max<int64_t>(1, reg.trainable_numel())},
      {"replica_grad_bytes", workers.replica_grad_bytes()}, {"peak_rss_mb", spes::peak_rss_mb()}};
  if (dev.is_cuda())
    out["gpu_peak_allocated_mb"] = spes::gpu_memory_stats(dev).peak_allocated / double(1 << 20);
  if (!profile_summary.is_null()) out["profile"] = profile_summary;
  if (measured_state_bytes >= 0) out["optimizer_state_measured_bytes"] = measured_state_bytes;
  if (host_syncs >= 0) out["host_syncs_per_step"] = static_cast<double>(host_syncs) / steps;
  if (peak_per_cpu_s > 0)
    out["mfu_cpu_time"] = batch * T * fpt / cpu_secs / peak_per_cpu_s;
  std::cout << out.dump() << std::endl;
  return 0;
}
