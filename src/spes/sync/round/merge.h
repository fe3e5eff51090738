// Expert-merging warm-up (SPES.md section 4), tensor by tensor: at a merge point each expert
// of a layer is pulled toward the mean of its K most similar other experts (cosine of
// vec(gate_proj)), gate_proj with gate_proj, up_proj with up_proj, down_proj with down_proj,
// all experts at once from their pre-merge values. The schedule is explicit: a merge point is
// the first sync at or after each multiple of merge_interval, alpha decays linearly with the
// step of the merge. Dot products are plain fp64 loops, so the result does not depend on the
// BLAS library or thread count (the server and `spes aggregate` must agree bit for bit).
// Leaves out: which tensors belong to which expert (the caller passes them).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "spes/io/config.h"
#include "spes/sync/round/round_clock.h"

namespace spes::sync {

struct MergeSchedule {
  int64_t interval = 0;      // 0: merging off
  RoundClock clock{1};       // the run's syncs (round_clock.h)
  int64_t decay_steps = 0;   // <= 0: no decay (alpha stays alpha_start)
  double alpha_start = 0;
  int64_t topk = 4;

  static MergeSchedule from_config(const Config& cfg);
  // True when the sync at `step` is the first sync at or after a multiple of `interval`: some
  // m >= 1 with clock.previous_sync_step(step) < m * interval <= step.
  bool is_merge_point(int64_t step) const;
  // alpha_start * max(0, 1 - step / decay_steps); 0 when `step` is not a merge point.
  double alpha(int64_t step) const;
};

// One expert's three matrices (tensors updated in place by experts_merge_layer).
struct ExpertMats {
  torch::Tensor gate, up, down;  // gate_proj [F, D], up_proj [F, D], down_proj [D, F]
};

// [E, E] fp64 cosine similarity of vec(gate_proj) between the experts of one layer.
std::vector<std::vector<double>> gate_cosine_matrix(const std::vector<ExpertMats>& experts);
// Mean of the cosine over unordered pairs e < e' (0 for fewer than two experts).
double mean_pairwise(const std::vector<std::vector<double>>& cos);
// Donors of each expert: the k most similar other experts (ties: lower index first),
// returned in ascending expert order. k is clipped to E - 1. Experts marked in `excluded`
// (empty: none) are never donors (flagged by the server's run-long drift bound, or their
// owner's upload was rejected); an expert with fewer candidates gets fewer donors.
std::vector<std::vector<int64_t>> merge_donors(const std::vector<std::vector<double>>& cos,
                                               int64_t k, const std::vector<bool>& excluded = {});
// P_e <- (1 - alpha) P_e + alpha * mean_{d in donors[e]} P_d for every expert of the layer,
// simultaneously (all new values are computed from pre-merge values before any is written), in
// fp32: the mean as the donors' sum (in donor order) divided by their count, then
// P_e * (1 - alpha) + alpha * mean. The matrices must be contiguous fp32 CPU tensors.
void experts_merge_layer(std::vector<ExpertMats>& experts,
                         const std::vector<std::vector<int64_t>>& donors, double alpha);

}  // namespace spes::sync
