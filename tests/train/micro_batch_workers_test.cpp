// Micro-batches on two threads at once (train/micro_batch_workers.h) against the same
// micro-batches one after the other: the same gradients in the model's own buffers, tensors
// that only the second worker touched still count for the optimizer, the replicas start every
// step from zero, frozen tensors get no replica buffer, and a worker's error reaches the caller.
#include <gtest/gtest.h>

#include <stdexcept>

#include "model/tiny_model_config.h"
#include "spes/model/losses.h"
#include "spes/train/micro_batch_workers.h"
#include "spes/train/optimizer.h"

using namespace spes;

namespace {

// Restores the intra-op thread count a test changed.
struct ThreadCount {
  int saved = at::get_num_threads();
  explicit ThreadCount(int n) { at::set_num_threads(n); }
  ~ThreadCount() { at::set_num_threads(saved); }
};

struct Fixture {
  Config cfg;
  std::unique_ptr<Transformer> model;
  std::unique_ptr<ParamRegistry> reg;
  std::unique_ptr<AdamW> opt;
  explicit Fixture(std::vector<std::string> frozen = {}) {
    cfg.model = spes::testing::tiny_model_config();
    cfg.frozen_experts = std::move(frozen);
    model = std::make_unique<Transformer>(cfg.model);
    model->init_weights(3);
    reg = std::make_unique<ParamRegistry>(*model, cfg, Ownership::from_config(cfg), 0);
    opt = std::make_unique<AdamW>(reg->trainable(), cfg.optimizer);
    opt->use_persistent_grads();
  }
  std::vector<torch::Tensor> grads() const {
    std::vector<torch::Tensor> g;
    for (const auto& e : reg->trainable()) g.push_back(e.tensor.grad().clone());
    return g;
  }
};

torch::Tensor batch_tokens(int64_t micro_batches, int64_t rows, int64_t seq, int64_t vocab) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  return at::randint(vocab, {micro_batches * rows, seq + 1}, gen, torch::kInt64);
}

// Forward + backward of micro-batch i (rows [i*2, i*2+2)) of `tokens` on `m`.
void micro_step(const Transformer& m, const torch::Tensor& tokens, int64_t i, int64_t n) {
  torch::Tensor rows = tokens.narrow(0, i * 2, 2);
  const int64_t T = rows.size(1) - 1;
  LossTerms l = compute_losses(m, rows.narrow(1, 0, T), rows.narrow(1, 1, T));
  (l.total / static_cast<double>(n)).backward();
}

}  // namespace

TEST(MicroBatchWorkers, TwoWorkersGiveTheGradientsOfSequentialAccumulation) {
  ThreadCount threads(2);
  Fixture seq, par;
  const int64_t n = 4;
  torch::Tensor tokens = batch_tokens(n, 2, seq.cfg.model.max_sequence_length, 32);
  MicroBatchWorkers one(*seq.model, seq.reg->trainable(), 1);
  MicroBatchWorkers two(*par.model, par.reg->trainable(), 2);
  ASSERT_EQ(two.workers(), 2);
  for (int step = 0; step < 2; ++step) {  // the second step starts from zeroed replicas
    one.run(n, [&](const Transformer& m, int64_t i) { micro_step(m, tokens, i, n); });
    two.run(n, [&](const Transformer& m, int64_t i) { micro_step(m, tokens, i, n); });
    auto g1 = seq.grads(), g2 = par.grads();
    ASSERT_EQ(g1.size(), g2.size());
    double total = 0;
    for (const auto& g : g2) total += g.abs().sum().item<double>();
    EXPECT_GT(total, 0.0);
    for (size_t k = 0; k < g1.size(); ++k) {
      EXPECT_TRUE(torch::allclose(g1[k], g2[k], 1e-5, 1e-7))
          << "step " << step << " " << seq.reg->trainable()[k].name << " max diff "
          << (g1[k] - g2[k]).abs().max().item<double>();
    }
    seq.opt->step(1e-3, 1.0);
    par.opt->step(1e-3, 1.0);
    seq.opt->zero_grad();
    par.opt->zero_grad();
    for (size_t k = 0; k < g1.size(); ++k)
      EXPECT_TRUE(torch::allclose(seq.reg->trainable()[k].tensor, par.reg->trainable()[k].tensor,
                                  1e-5, 1e-7));
  }
}

TEST(MicroBatchWorkers, AGradientOnlyTheSecondWorkerComputedIsApplied) {
  ThreadCount threads(2);
  Fixture seq, par;
  torch::Tensor tokens = batch_tokens(2, 2, seq.cfg.model.max_sequence_length, 32);
  MicroBatchWorkers one(*seq.model, seq.reg->trainable(), 1);
  MicroBatchWorkers two(*par.model, par.reg->trainable(), 2);
  // Micro-batch 0 (worker 0: the model itself) computes nothing; micro-batch 1 runs on the
  // replica, so every gradient the model gets comes from the replica's buffers.
  auto only_second = [&](const Transformer& m, int64_t i) {
    if (i == 1) micro_step(m, tokens, i, 2);
  };
  std::vector<torch::Tensor> before;
  for (const auto& e : par.reg->trainable()) before.push_back(e.tensor.clone());
  one.run(2, only_second);
  two.run(2, only_second);
  seq.opt->step(1e-2, 1.0);
  par.opt->step(1e-2, 1.0);
  size_t moved = 0;
  for (size_t k = 0; k < before.size(); ++k) {
    const torch::Tensor &a = seq.reg->trainable()[k].tensor, &b = par.reg->trainable()[k].tensor;
    EXPECT_TRUE(torch::allclose(a, b, 1e-5, 1e-7)) << seq.reg->trainable()[k].name;
    moved += !torch::equal(before[k], b);
  }
  // Every shared tensor sees every token; experts only those routed to them.
  EXPECT_GT(moved, before.size() / 2);
}

TEST(MicroBatchWorkers, FrozenTensorsHaveNoReplicaBuffers) {
  Fixture f({"*:2", "*:3"});
  MicroBatchWorkers two(*f.model, f.reg->trainable(), 2);
  EXPECT_EQ(two.replica_grad_bytes(), f.reg->trainable_numel() * 4);
  EXPECT_LT(f.reg->trainable_numel(), f.model->num_params());
  MicroBatchWorkers one(*f.model, f.reg->trainable(), 1);
  EXPECT_EQ(one.replica_grad_bytes(), 0);
}

TEST(MicroBatchWorkers, AWorkersErrorReachesTheCaller) {
  ThreadCount threads(2);
  Fixture f;
  MicroBatchWorkers two(*f.model, f.reg->trainable(), 2);
  EXPECT_THROW(two.run(2,
                       [&](const Transformer&, int64_t i) {
                         if (i == 1) throw std::runtime_error("bad micro-batch");
                       }),
               std::runtime_error);
}

TEST(MicroBatchWorkers, WorkersFollowThreadsAndMicroBatches) {
  ThreadCount threads(2);
  EXPECT_EQ(MicroBatchWorkers::workers_for(1, torch::kCPU), 1);
  EXPECT_EQ(MicroBatchWorkers::workers_for(4, torch::kCPU), 2);
  EXPECT_EQ(MicroBatchWorkers::workers_for(4, torch::Device(torch::kCUDA, 0)), 1);
}
