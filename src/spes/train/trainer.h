// The training loop of one node: model + registry + AdamW + data, gradient accumulation,
// clipping, LR schedule, validation, checkpoints, metrics.jsonl and progress. A step is queued
// on the device without waiting for it and its figures are read afterwards (on a GPU no host
// synchronisation inside a step; between steps the next one is queued first where nothing has
// to see the weights in between). A StepObserver (the SPES sync client) runs after each
// optimizer step and may replace weights.
#pragma once
#include <nlohmann/json.hpp>

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "spes/data/loader.h"
#include "spes/model/initial_weights.h"
#include "spes/model/registry.h"
#include "spes/model/transformer.h"
#include "spes/train/checkpoint.h"
#include "spes/train/distributed.h"
#include "spes/train/grad_allreduce.h"
#include "spes/io/tensorboard_writer.h"
#include "spes/train/metrics.h"
#include "spes/train/micro_batch_workers.h"
#include "spes/train/optimizer.h"
#include "spes/train/step_figures.h"

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
  // What the observer has for metrics.jsonl that no step carried (e.g. the join record of a
  // node that joined at the run's last step, or was stopped before its first): written as one
  // line, with the step and time, before on_finish or on_stop. Empty: nothing to write.
  virtual nlohmann::json unreported(Trainer&) { return {}; }
  // The run stops early (SIGINT/SIGTERM, common/stop_signal.h), after its last complete step
  // and before its checkpoint is written: end what is in flight, leave.
  virtual void on_stop(Trainer&) {}
  // Before a checkpoint is written: puts the observer's own state into it (TrainState::extra,
  // sync_tensors); after a resume on_start finds it in Trainer::state().
  virtual void save_state(TrainState&) {}
};

struct TrainerOptions {
  int64_t node_id = 0;
  std::string resume_from;          // checkpoint dir; "auto": OUT/checkpoint if it exists
  ProgressMode progress = ProgressMode::Auto;
  std::string progress_prefix;      // e.g. "[node 1] "
  StepObserver* observer = nullptr; // not owned
  // This process is one rank of a node's data-parallel group (not owned; null: one process).
  // Each rank runs global_train_batch_size / size of the step's sequences on dist->device();
  // gradients are all-reduced during backward; only rank 0 writes metrics and checkpoints.
  DistGroup* dist = nullptr;
  // Also checkpoint when this many seconds passed since the last checkpoint (0: only every
  // save_interval steps); `spes train` sets 600 (--checkpoint-every).
  double checkpoint_every_s = 0;
};

// One optimizer step queued on the device whose figures (loss terms, gradient norm) have not
// been read yet (Trainer::queue_step, settle_step).
struct QueuedStep {
  int64_t step = 0;    // its number (1-based count of completed steps)
  int64_t tokens = 0;  // training tokens after it
  double lr = 0;
  std::chrono::steady_clock::time_point start;
  double queue_s = 0;      // how long queue_step took
  StepFigures figures;     // [grad_norm, then total, ce, lb, router_z, z per row]
  int64_t term_rows = 0;   // rows of loss terms (micro-batches, or 1 when summed over ranks)
  nlohmann::json memory;   // the first step of the process: measured memory by part
};

struct EvalResult {
  double loss = 0;        // mean next-token cross-entropy (nats)
  double perplexity = 0;
  int64_t tokens = 0;
};

class Trainer {
 public:
  // `initial`: the starting weights when the run names model.init_checkpoint (read by the
  // command, interop/init_checkpoint.h; released once copied into the model).
  Trainer(const Config& cfg, const std::string& out_dir, TrainerOptions opts = {},
          std::optional<InitialWeights> initial = std::nullopt);
  ~Trainer();

  // Trains until total_steps, evaluating and checkpointing as configured; the final
  // checkpoint is OUT/checkpoint. Returns the final validation result. A stop requested by a
  // signal (common/stop_signal.h; agreed by every rank) ends the run at the next step
  // boundary: the steps already queued are finished, OUT/checkpoint is written and run()
  // returns without the final evaluation (stopped_by() then names the signal).
  EvalResult run();
  // The signal that stopped run() early; 0 when it ran to the end.
  int stopped_by() const { return stopped_by_; }
  // One optimizer step (accumulated micro-batches); returns its metrics record.
  // = settle_step(queue_step()).
  nlohmann::json train_step();
  // Queues one optimizer step on the device and advances the step count, token count and data
  // position. Never waits for the device: on a GPU (amp_bf16, grouped experts) nothing in it
  // synchronises with the host (tests/train/cuda_sync_test.cpp); its figures are copied to the
  // host behind it. run() queues the next step before reading this one's figures wherever
  // nothing has to see the weights in between.
  QueuedStep queue_step();
  // Waits for a queued step's figures (only those: later steps may still run) and returns its
  // metrics record. Throws when its gradient norm is not finite (the device skipped that update).
  nlohmann::json settle_step(const QueuedStep& q);
  // The metrics record of the last train_step() (null before the first).
  const nlohmann::json& last_step_record() const { return last_record_; }
  EvalResult evaluate(int64_t max_batches);
  void save_checkpoint(const std::string& dir) const;

  const Config& config() const { return cfg_; }
  bool autocast() const { return autocast_; }  // bf16 autocast (precision amp_bf16 resolved)
  Transformer& model() { return *model_; }
  const ParamRegistry& registry() const { return *registry_; }
  // Which experts this node trains now (epoch 0: Ownership::from_config; a resumed run: the
  // map its checkpoint recorded).
  const Ownership& ownership() const { return *ownership_; }
  // At a step boundary (nothing queued), every rank of a --nproc-per-node group with the same
  // map: this node now trains the experts `next` gives it; the shared tensors are unchanged.
  // Experts it keeps keep their AdamW state bit for bit; experts it gains start from `handed`
  // (exactly their moments, checked: names, shapes, finite) when given, else from zero moments
  // with a learning-rate re-warm-up for those experts only (linear over
  // spes_config.rewarmup_steps steps, default: the scheduler's t_warmup); experts it loses
  // become frozen (their gradient buffers and moments freed, frozen low-precision storage where
  // the layout uses it). Weights are not touched. `handed` may cover some of the gained experts
  // (all three tensors of each); on a group of ranks rank 0's is used. Bad input (a map of
  // another shape, moments of a tensor not gained, of a wrong shape, not finite) throws before
  // anything changes. The registry and optimizer objects stay the same objects (their contents
  // change); the state's map (state().ownership) follows; ownership_epoch is the caller's.
  void change_ownership(const Ownership& next, const ExpertMoments* handed = nullptr);
  // --nproc-per-node: rank 0's sync client runs alone (train/rank0_observer.h). While `alone`,
  // change_ownership on rank 0 changes rank 0 only (no call that needs the other ranks) and
  // keeps the change for follow_rank0_ownership().
  void set_rank0_alone(bool alone) { rank0_alone_ = alone; }
  // Rank 0: whether it changed its map alone since the last follow_rank0_ownership().
  bool rank0_changed_ownership() const { return rank0_before_ != nullptr; }
  // Every rank at the same step boundary, after rank 0 changed its map alone: the other ranks
  // change to rank 0's map, with rank 0's handed moments of the experts they gain (exactly),
  // then every rank checks that all hold the same map.
  void follow_rank0_ownership();
  // The AdamW moments of the given experts this node trains now (for a graceful handoff);
  // throws for an expert it does not train.
  ExpertMoments expert_moments(const std::vector<std::pair<int64_t, int64_t>>& layer_expert) const;
  AdamW& optimizer() { return *optimizer_; }
  TrainState& state() { return state_; }
  const TrainState& state() const { return state_; }
  const std::string& out_dir() const { return out_dir_; }
  BatchLoader& train_loader() { return *train_loader_; }
  bool has_validation() const { return val_loader_ != nullptr; }
  DistGroup* dist() const { return opts_.dist; }
  bool is_rank0() const { return !opts_.dist || opts_.dist->rank() == 0; }

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
  std::unique_ptr<GradientAllReduce> reducer_;  // with opts_.dist
  std::unique_ptr<BatchLoader> train_loader_, val_loader_;
  std::unique_ptr<MetricsLog> metrics_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;  // metrics.jsonl's figures as scalars
  TrainState state_;
  // The constructor's steps, in order: the settings checked (threads, batch split over ranks,
  // data paths, the model against this machine's memory), the loaders opened, the checkpoint
  // to resume chosen ("" for none), the model built for its map (the checkpoint's or the
  // config's) with the registry, the optimizer and the micro-batch workers (and all-reduce),
  // the checkpoint's state loaded (and rank 0's weights broadcast), the logs opened (rank 0).
  void check_settings() const;
  void open_data();
  std::string checkpoint_to_resume() const;
  void build_model(const std::string& resume, std::optional<InitialWeights> initial);
  void build_optimizer();
  void restore_state(const std::string& resume);
  void open_logs(const std::string& resume);
  // Data-parallel ranks: every rank's final weights hash equal rank 0's (or this throws).
  void check_ranks_agree() const;
  // At a step boundary: whether to stop (a signal) and whether a checkpoint is due by the
  // clock (checkpoint_every_s), the same on every rank.
  struct BoundaryDecision {
    int stop = 0;
    bool checkpoint_due = false;
  };
  BoundaryDecision decide_at_boundary() const;
  void stop_early(int sig, ProgressDisplay& progress);
  // change_ownership's parts (ownership_change.cpp): the registry entries of the experts gained
  // from `before` to `after` ([layer][expert] trainable tables); the rebuild of every part over
  // the new trainable set, with `given` moments for gained experts (checked before).
  std::vector<RegistryEntry> gained_entries(const std::vector<std::vector<bool>>& before,
                                            const std::vector<std::vector<bool>>& after) const;
  void rebuild_for_ownership(const Ownership& next, const std::vector<std::vector<bool>>& before,
                             const std::vector<std::vector<bool>>& after,
                             const ExpertMoments* given);
  // While rank 0 changes alone: the map before its first change, the moments it was handed.
  bool rank0_alone_ = false;
  std::unique_ptr<Ownership> rank0_before_;
  ExpertMoments rank0_handed_;
  // The observer's record that no step carried (StepObserver::unreported), on its own line.
  void write_unreported();
  std::chrono::steady_clock::time_point last_checkpoint_ = std::chrono::steady_clock::now();
  int stopped_by_ = 0;
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  nlohmann::json last_record_;  // last_step_record()
  bool memory_logged_ = false;  // the first step of this process logs a "memory" record
};

}  // namespace spes
