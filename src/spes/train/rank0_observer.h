// On a node of several ranks (train/distributed.h) only rank 0 talks to the sync server. This
// StepObserver wraps the node's real observer (the sync client): rank 0 runs it alone; then every
// rank receives from rank 0 what it may have changed (weights, step, tokens, sync round, data
// position, and the ownership map with its epoch: a map change rank 0 made alone is followed by
// every other rank, with rank 0's handed moments, Trainer::follow_rank0_ownership), by
// broadcast, so the ranks stay identical. Costs one small broadcast per step and a broadcast of
// the whole model after steps where rank 0's observer changed something.
// Leaves out: the observer's metrics (only rank 0 writes metrics.jsonl).
#pragma once
#include "spes/train/trainer.h"

namespace spes {

class Rank0Observer : public StepObserver {
 public:
  // inner: used on rank 0 only (may be null).
  Rank0Observer(DistGroup& group, StepObserver* inner);
  void on_start(Trainer& t) override;
  nlohmann::json after_step(Trainer& t, int64_t step) override;
  void on_finish(Trainer& t) override;
  nlohmann::json unreported(Trainer& t) override;  // rank 0's (only rank 0 writes metrics)
  void on_stop(Trainer& t) override;
  void save_state(TrainState& s) override;  // rank 0's (only rank 0 writes checkpoints)

 private:
  // Rank 0 says whether anything changed since `before`; if so every rank gets its state and
  // weights.
  void share(Trainer& t, const std::vector<uint32_t>& before, const TrainState& state_before);
  std::vector<uint32_t> versions(const Trainer& t) const;

  DistGroup& group_;
  StepObserver* inner_;
};

}  // namespace spes
