// Round <-> step arithmetic of SPES sync, in one place: round r >= 1 is the sync at step
// r * spes_config.sync_steps (after that many optimizer steps); round 0 is the initial model at
// step 0. Used by the server, the node, `spes aggregate` and the run report.
// Leaves out: what a round does (aggregate.h), when it closes (server/open_round.h).
#pragma once
#include <cstdint>

#include "spes/common/error.h"
#include "spes/io/config.h"

namespace spes::sync {

class RoundClock {
 public:
  explicit RoundClock(int64_t sync_steps) : sync_steps_(sync_steps) {}
  explicit RoundClock(const Config& cfg) : RoundClock(cfg.spes_config.sync_steps) {}
  int64_t sync_steps() const { return sync_steps_; }
  // The step at which round `round` syncs. A round whose step would not fit in 64 bits (a
  // number from the network) is refused, never wrapped.
  int64_t step_of(int64_t round) const {
    int64_t step = 0;
    if (round < 0 || __builtin_mul_overflow(round, sync_steps_, &step))
      fail("round {} is out of range (round x spes_config.sync_steps={} must be a step count)",
           round, sync_steps_);
    return step;
  }
  // Whether a round syncs at `step`: a positive multiple of sync_steps.
  bool is_sync_step(int64_t step) const { return step > 0 && step % sync_steps_ == 0; }
  // The round that syncs at `step` (for a step between syncs: the latest round before it).
  int64_t round_at(int64_t step) const { return step / sync_steps_; }
  // The sync before the one at `step` (0, the initial model, for the first).
  int64_t previous_sync_step(int64_t step) const {
    return step > sync_steps_ ? step - sync_steps_ : 0;
  }
  // Whether `step` lies between the sync at `synced_step` and the next one (both excluded).
  bool between_syncs(int64_t step, int64_t synced_step) const {
    return step > synced_step && step < synced_step + sync_steps_;
  }

 private:
  int64_t sync_steps_;
};

}  // namespace spes::sync
