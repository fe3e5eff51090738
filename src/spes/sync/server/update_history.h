// Shared updates against the history of accepted ones (docs/SECURITY.md, "a lone early
// uploader"): the comparison across nodes (UpdateBounds::outliers) needs two or more uploads,
// so a node that was the only one to upload before a round's deadline could publish any update
// inside the per-round bounds (7x the median honest norm was seen). Here, when a round closes,
// each accepted upload's update of an averaged tensor (shared tensors; every tensor in
// fedavg/diloco) is also compared with that tensor's accepted updates over the last
// spes_config.drift_window_rounds published rounds (each round counted by the median of its
// nodes' updates): above spes_config.outlier_factor x their median, the upload is refused.
// Works with one upload. The reference is floored at 1e-2 x the tensor's published norm (and
// an RMS of 1e-5), so a run whose first rounds barely moved a tensor can still
// move it; with no history yet (the first round) there is no check. Saved with the drift
// window (to_json / restore). Not thread-safe: RoundState's lock guards it.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "spes/io/config.h"
#include "spes/sync/round/plan.h"
#include "spes/sync/server/update_bounds.h"

namespace spes::sync {

class UpdateHistory {
 public:
  UpdateHistory(const Config& cfg, const RoundPlan& plan, const UpdateBounds& bounds);

  using Uploads = std::vector<std::pair<int64_t, const std::vector<double>*>>;
  // Among a round's accepted uploads (node, ||upload_t - published_t||^2 per tensor), those
  // whose update of an averaged tensor is above outlier_factor x the history's reference.
  std::vector<UpdateBounds::Outlier> outliers(const Uploads& uploads) const;
  // Per tensor, the median of the accepted uploads' update norms (-1 where none uploaded it or
  // it did not move):
  // what published() takes once the round is published.
  std::vector<double> round_medians(const Uploads& uploads) const;
  void published(std::vector<double> medians);
  // {"rounds": [[...], ...]} and back; restore() refuses (false, unchanged) rows of another
  // length, more than the window, or values that are not finite numbers >= -1.
  nlohmann::json to_json() const;
  bool restore(const nlohmann::json& j);
  void reset() { rounds_.clear(); }

 private:
  // The reference update norm of tensor t (-1: no history).
  double reference(size_t t) const;

  const Config& cfg_;
  const RoundPlan& plan_;
  const UpdateBounds& bounds_;
  std::deque<std::vector<double>> rounds_;  // oldest first, at most drift_window_rounds
};

}  // namespace spes::sync
