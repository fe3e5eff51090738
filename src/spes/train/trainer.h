// The training loop of one node: model + registry + AdamW + data, gradient accumulation,
// clipping, LR schedule, validation, checkpoints, metrics.jsonl and progress. A StepObserver
// (the SPES sync client) runs after each optimizer step and may replace weights.
#pragma once
#include <nlohmann/json.hpp>

#include <memory>
#include <string>

#include "spes/data/loader.h"
#include "spes/model/registry.h"
#include "spes/model/transformer.h"
#include "spes/train/checkpoint.h"
#include "spes/train/metrics.h"
#include "spes/train/micro_batch_workers.h"
#include "spes/train/optimizer.h"

namespace spes {

class Trainer;

class StepObserver {
 public:
  virtual ~StepObserver() = default;
  // Before the first step (after any resume): e.g. fetch the initial model from a server.
  virtual void on_start(Trainer&) {}
  // After optimizer step `step` (1-based count of completed steps). The returned object is
  // merged into that step's metrics line (e.g. {"sync": {...}}).
  virtual nlohmann::json after_step(Trainer&, int64_t /*step*/) { return {}; }
  virtual void on_finish(Trainer&) {}
};

struct TrainerOptions {
  int64_t node_id = 0;
  std::string resume_from;          // checkpoint dir; "auto": OUT/checkpoint if it exists
  ProgressMode progress = ProgressMode::Auto;
  std::string progress_prefix;      // e.g. "[node 1] "
  StepObserver* observer = nullptr; // not owned
};

struct EvalResult {
  double loss = 0;        // mean next-token cross-entropy (nats)
  double perplexity = 0;
  int64_t tokens = 0;
};

class Trainer {
 public:
  Trainer(const Config& cfg, const std::string& out_dir, TrainerOptions opts = {});
  ~Trainer();

  // Trains until total_steps, evaluating and checkpointing as configured; the final
  // checkpoint is OUT/checkpoint. Returns the final validation result.
  EvalResult run();
  // One optimizer step (accumulated micro-batches); returns its metrics record.
  nlohmann::json train_step();
  // The metrics record of the last train_step() (null before the first).
  const nlohmann::json& last_step_record() const { return last_record_; }
  EvalResult evaluate(int64_t max_batches);
  void save_checkpoint(const std::string& dir) const;

  const Config& config() const { return cfg_; }
  Transformer& model() { return *model_; }
  const ParamRegistry& registry() const { return *registry_; }
  AdamW& optimizer() { return *optimizer_; }
  TrainState& state() { return state_; }
  const std::string& out_dir() const { return out_dir_; }
  BatchLoader& train_loader() { return *train_loader_; }
  bool has_validation() const { return val_loader_ != nullptr; }

 private:
  Config cfg_;
  std::string out_dir_;
  TrainerOptions opts_;
  torch::Device device_;
  bool autocast_;
  std::unique_ptr<Transformer> model_;
  std::unique_ptr<Ownership> ownership_;
  std::unique_ptr<ParamRegistry> registry_;
  std::unique_ptr<AdamW> optimizer_;
  std::unique_ptr<MicroBatchWorkers> workers_;
  std::unique_ptr<BatchLoader> train_loader_, val_loader_;
  std::unique_ptr<MetricsLog> metrics_;
  TrainState state_;
  nlohmann::json last_record_;  // last_step_record()
  bool memory_logged_ = false;  // the first step of this process logs a "memory" record
};

}  // namespace spes
