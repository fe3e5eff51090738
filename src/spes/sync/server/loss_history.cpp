// Bounded loss curve of one node (see loss_history.h).
#include "spes/sync/server/loss_history.h"

#include <algorithm>
#include <cmath>

#include "spes/common/error.h"

namespace spes::sync {

LossHistory::LossHistory(size_t capacity) : capacity_(capacity) {
  SPES_CHECK(capacity >= 2, "LossHistory: capacity must be >= 2, found {}", capacity);
}

void LossHistory::add(int64_t step, double loss) {
  if (!std::isfinite(loss)) return;
  if (latest_ && step <= latest_->step) {
    kept_.erase(std::remove_if(kept_.begin(), kept_.end(),
                               [&](const LossPoint& p) { return p.step >= step; }),
                kept_.end());
  }
  latest_ = LossPoint{step, loss};
  if (step % stride_ != 0) return;
  kept_.push_back(*latest_);
  while (kept_.size() > capacity_) {
    stride_ *= 2;
    kept_.erase(std::remove_if(kept_.begin(), kept_.end(),
                               [&](const LossPoint& p) { return p.step % stride_ != 0; }),
                kept_.end());
  }
}

std::vector<LossPoint> LossHistory::points() const {
  std::vector<LossPoint> out = kept_;
  if (latest_ && (out.empty() || out.back().step != latest_->step)) out.push_back(*latest_);
  return out;
}

}  // namespace spes::sync
