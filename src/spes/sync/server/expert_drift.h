// The run-long bound on each expert (docs/SECURITY.md, "an owner's expert drifts"): an expert
// has one owner and nobody to compare its update with, so the per-round and per-window bounds
// (update_bounds.h) let its owner grow it step by step (x1.3 a round passed them all). Here,
// for every expert tensor t (role Expert) of an upload:
//   - peers: ||upload_t|| <= spes_config.max_expert_peer_ratio x the median of the current
//     published norms of the same tensor (same projection) of the layer's other experts;
//   - own history: ||upload_t|| <= spes_config.max_expert_growth x the norm t had when the run
//     started (the first model this server published, kept across restarts).
// Norms are floored at an RMS of 1e-3, as in update_bounds.h. An expert one of whose tensors
// breaks a bound is refused and flagged for the rest of the run; merging (merge.h) never takes
// from a flagged expert. State is keyed by the expert tensors' names, not by owner, so a
// change of owner keeps it; it is saved with the drift window (to_json / restore, by
// RoundState into drift_window.json) and restored when the server resumes.
// Thread-safe (its own lock): uploads are checked outside the round state's lock.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "spes/io/config.h"
#include "spes/sync/round/plan.h"
#include "spes/sync/server/update_bounds.h"

namespace spes::sync {

// (layer, expert)
using ExpertKey = std::pair<int64_t, int64_t>;

class ExpertDrift {
 public:
  ExpertDrift(const Config& cfg, const RoundPlan& plan, const std::vector<torch::Tensor>& pub);

  // Whether tensor `t` (model order) is an expert tensor (checked here).
  bool tracks(size_t t) const { return start_[t] >= 0; }
  // Checks one node's upload given ||upload_t||^2 for every model tensor (read for the expert
  // tensors it sends). Flags every expert one of whose tensors breaks a bound, and then
  // throws SyncError(InvalidArgument) naming the first tensor and its bound.
  void check_upload(int64_t node, const std::vector<double>& norm_sq, const std::string& origin);
  // The experts flagged so far, ascending.
  std::set<ExpertKey> flagged() const;
  // Starts over at `pub`: its norms count as the start, nothing is flagged (a server resumed
  // without saved state).
  void reset(const std::vector<torch::Tensor>& pub);
  // A round was published: `pub` are the new tensors.
  void published(const std::vector<torch::Tensor>& pub);
  // {"start": {tensor name: norm}, "flagged": [[layer, expert], ...]} and back; restore()
  // needs the start norm of every expert tensor of the model (finite, >= 0) and flagged experts
  // the model has (false, state unchanged, otherwise; start norms of other names are ignored).
  nlohmann::json to_json() const;
  bool restore(const nlohmann::json& j);

 private:
  // Why tensor t at norm n breaks a bound ("" if it does not); mu_ held.
  std::string breach(size_t t, double n) const;

  const Config& cfg_;
  const RoundPlan& plan_;
  mutable std::mutex mu_;
  std::vector<double> floor_;               // per tensor: 1e-3 x sqrt(numel)
  std::vector<double> start_;               // per tensor: norm at the run's start (-1: not expert)
  std::vector<double> now_;                 // per tensor: norm in the latest published model
  std::vector<std::vector<size_t>> peers_;  // per expert tensor: the same tensor of the others
  std::set<ExpertKey> flagged_;
};

}  // namespace spes::sync
