// How far one upload may move the model, beyond being finite and well-formed: the sync
// server's defence against a node that poisons the model within what it is allowed to send
// (docs/SECURITY.md). Three bounds, each on one tensor at a time, so that a node cannot spend a
// budget over all of its tensors on one small tensor:
//   - per round: ||upload_t - published_t|| <= spes_config.max_tensor_update_ratio x
//     ||published_t||;
//   - drift: over the last spes_config.drift_window_rounds rounds, the path the tensor would
//     take from its published value at the window's start (the published changes since, plus
//     this upload's) <= spes_config.max_drift_ratio x the norm it had then; an expert has one
//     owner, so this is what bounds it against its own history;
//   - across nodes, for tensors combined by averaging (shared tensors; every tensor in
//     fedavg/diloco): an update above spes_config.outlier_factor x the median of the other
//     nodes' updates of that tensor is refused when the round closes (an expert's median floored
//     at 1e-2 x its norm: in those modes an expert moves only on the nodes routed to it).
// A tensor's norm is floored at an RMS of 1e-3 (a tensor at or near zero can still move).
// The drift window is saved after every published round (to_json, RoundStore) and restored
// when the server resumes that round (restore); without a matching file it starts empty.
// Not thread-safe: RoundState's lock guards it. Leaves out: the whole-upload bound
// (max_update_norm_ratio, upload_staging.cpp) and the aggregation statistic (aggregate.h).
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "spes/io/config.h"
#include "spes/sync/round/plan.h"

namespace spes::sync {

// The median of `v` (not empty): the middle value, or the mean of the two middle ones.
double median_of(std::vector<double> v);

class UpdateBounds {
 public:
  UpdateBounds(const Config& cfg, const RoundPlan& plan, const std::vector<torch::Tensor>& pub);

  // Checks one node's upload given ||upload_t - published_t||^2 for every model tensor (0 for
  // tensors it does not send). Throws SyncError(InvalidArgument) naming the tensor and the
  // bound it breaks.
  void check_upload(int64_t node, const std::vector<double>& diff_sq,
                    const std::string& origin) const;

  struct Outlier {
    int64_t node;
    std::string why;
  };
  // Among a round's accepted uploads (node, its diff_sq as above), those whose update of an
  // averaged tensor exceeds outlier_factor x the median of the other nodes' updates of it.
  std::vector<Outlier> outliers(
      const std::vector<std::pair<int64_t, const std::vector<double>*>>& uploads) const;

  // The norm of tensor `t` in the latest published model.
  double published_norm(size_t t) const { return norms_.back()[t]; }
  // Starts the window over at `pub` (a server resumed from disk without a saved window).
  void reset(const std::vector<torch::Tensor>& pub);
  // The window as JSON ({"norms": [[...]], "changes": [[...]]}), and back; restore() refuses
  // (false, window unchanged) a window of another shape or with non-finite or negative values.
  nlohmann::json to_json() const;
  bool restore(const nlohmann::json& j);
  // A round was published: `change` per tensor (RoundOutcome::change), `pub` the new tensors.
  void published(const std::vector<double>& change, const std::vector<torch::Tensor>& pub);

 private:
  double base(size_t t, const std::vector<double>& norms) const;

  const Config& cfg_;
  const RoundPlan& plan_;
  std::vector<double> floor_;                 // per tensor: 1e-3 x sqrt(numel)
  std::deque<std::vector<double>> norms_;     // norms of the last W published models, oldest first
  std::deque<std::vector<double>> changes_;   // their changes since (the last W - 1 rounds)
};

}  // namespace spes::sync
