// One node's training-loss curve as the sync server keeps it for the dashboard: bounded and
// evenly thinned. It keeps the points whose step is a multiple of a stride that doubles (and
// drops the points off the new stride) whenever more than `capacity` are held, so the curve
// always spans the whole run at an even density, plus the latest point. A step at or before the
// latest one (a node restarted from an older checkpoint) replaces the points from that step on.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "spes/sync/wire/protocol.h"

namespace spes::sync {

class LossHistory {
 public:
  explicit LossHistory(size_t capacity = 2000);
  void add(int64_t step, double loss);  // non-finite losses are skipped
  std::vector<LossPoint> points() const;  // ascending steps, the latest point last
  int64_t stride() const { return stride_; }

 private:
  size_t capacity_;
  int64_t stride_ = 1;
  std::vector<LossPoint> kept_;
  std::optional<LossPoint> latest_;
};

}  // namespace spes::sync
