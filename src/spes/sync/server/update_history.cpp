// Shared updates against the history of accepted updates (see update_history.h).
#include "spes/sync/server/update_history.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace spes::sync {

namespace {
bool uploads_tensor(const RoundPlan& plan, int64_t node, size_t t) {
  const auto& up = plan.upload_of(node);
  return std::find(up.begin(), up.end(), t) != up.end();
}
}  // namespace

UpdateHistory::UpdateHistory(const Config& cfg, const RoundPlan& plan, const UpdateBounds& bounds)
    : cfg_(cfg), plan_(plan), bounds_(bounds) {}

double UpdateHistory::reference(size_t t) const {
  std::vector<double> seen;
  for (const auto& r : rounds_)
    if (r[t] >= 0) seen.push_back(r[t]);
  if (seen.empty()) return -1;
  double numel = 1;
  for (int64_t d : plan_.tensors()[t].shape) numel *= static_cast<double>(d);
  const double floor = std::max(1e-2 * bounds_.published_norm(t), 1e-5 * std::sqrt(numel));
  return std::max(median_of(seen), floor);
}

std::vector<UpdateBounds::Outlier> UpdateHistory::outliers(const Uploads& uploads) const {
  std::vector<UpdateBounds::Outlier> out;
  const double k = cfg_.spes_config.bounds.outlier_factor;
  if (k <= 0 || rounds_.empty()) return out;
  for (const auto& [node, diff] : uploads) {
    for (size_t t : plan_.upload_of(node)) {
      if (plan_.tensors()[t].rule != Combine::Mean) continue;
      const double ref = reference(t);
      const double d = std::sqrt((*diff)[t]);
      if (ref < 0 || d <= k * ref) continue;
      out.push_back({node, fmt::format(
          "its update of tensor '{}' has norm {:.4g}, {:.4g} x the median of the accepted "
          "updates of it over the last {} published rounds ({:.4g}), above "
          "spes_config.outlier_factor={}; the upload is rejected", plan_.tensors()[t].name, d,
          d / ref, rounds_.size(), ref, k)});
      break;
    }
  }
  return out;
}

std::vector<double> UpdateHistory::round_medians(const Uploads& uploads) const {
  std::vector<double> m(plan_.tensors().size(), -1.0);
  for (size_t t = 0; t < m.size(); ++t) {
    if (plan_.tensors()[t].rule != Combine::Mean) continue;
    std::vector<double> d;
    for (const auto& [node, diff] : uploads)
      if (uploads_tensor(plan_, node, t)) d.push_back(std::sqrt((*diff)[t]));
    // A round in which the tensor did not move says nothing about how far it moves.
    if (!d.empty() && median_of(d) > 0) m[t] = median_of(d);
  }
  return m;
}

void UpdateHistory::published(std::vector<double> medians) {
  rounds_.push_back(std::move(medians));
  while (static_cast<int64_t>(rounds_.size()) > cfg_.spes_config.bounds.drift_window_rounds)
    rounds_.pop_front();
}

nlohmann::json UpdateHistory::to_json() const {
  return {{"rounds", std::vector<std::vector<double>>(rounds_.begin(), rounds_.end())}};
}

bool UpdateHistory::restore(const nlohmann::json& j) {
  const size_t T = plan_.tensors().size();
  if (!j.is_object() || !j.contains("rounds") || !j["rounds"].is_array() ||
      static_cast<int64_t>(j["rounds"].size()) > cfg_.spes_config.bounds.drift_window_rounds)
    return false;
  std::deque<std::vector<double>> got;
  for (const auto& r : j["rounds"]) {
    if (!r.is_array() || r.size() != T) return false;
    std::vector<double> row;
    for (const auto& v : r) {
      if (!v.is_number()) return false;
      const double x = v.get<double>();
      if (!std::isfinite(x) || x < -1) return false;
      row.push_back(x);
    }
    got.push_back(std::move(row));
  }
  rounds_ = std::move(got);
  return true;
}

}  // namespace spes::sync
