// Per-tensor update, drift and cross-node bounds on uploads (see update_bounds.h).
#include "spes/sync/server/update_bounds.h"

#include <algorithm>
#include <cmath>

#include "spes/sync/wire/protocol.h"

namespace spes::sync {

namespace {
std::vector<double> norms_of(const std::vector<torch::Tensor>& pub) {
  std::vector<double> n;
  n.reserve(pub.size());
  for (const auto& t : pub) n.push_back(t.norm().item<double>());
  return n;
}

}  // namespace

double median_of(std::vector<double> v) {
  const size_t n = v.size();
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(n / 2), v.end());
  const double hi = v[n / 2];
  if (n % 2 == 1) return hi;
  return 0.5 * (hi + *std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(n / 2)));
}

UpdateBounds::UpdateBounds(const Config& cfg, const RoundPlan& plan,
                           const std::vector<torch::Tensor>& pub)
    : cfg_(cfg), plan_(plan) {
  for (const auto& t : pub) floor_.push_back(1e-3 * std::sqrt(static_cast<double>(t.numel())));
  norms_.push_back(norms_of(pub));
}

double UpdateBounds::base(size_t t, const std::vector<double>& norms) const {
  return std::max(norms[t], floor_[t]);
}

void UpdateBounds::check_upload(int64_t node, const std::vector<double>& diff_sq,
                                const std::string& origin) const {
  const SpesConfig& sc = cfg_.spes_config;
  const std::vector<double>& now = norms_.back();
  const std::vector<double>& start = norms_.front();
  for (size_t t : plan_.upload_of(node)) {
    const double d = std::sqrt(diff_sq[t]);
    const std::string& name = plan_.tensors()[t].name;
    if (sc.bounds.max_tensor_update_ratio > 0 && d > sc.bounds.max_tensor_update_ratio * base(t, now))
      sync_fail(SyncErrc::InvalidArgument, "{}: it moves tensor '{}' by {:.4g}, {:.4g} x the "
                "tensor's norm {:.4g}, above spes_config.max_tensor_update_ratio={}; the upload "
                "is rejected", origin, name, d, d / base(t, now), now[t],
                sc.bounds.max_tensor_update_ratio);
    if (sc.bounds.max_drift_ratio <= 0) continue;
    double path = d;
    for (const auto& c : changes_) path += c[t];
    if (path > sc.bounds.max_drift_ratio * base(t, start))
      sync_fail(SyncErrc::InvalidArgument, "{}: over the last {} rounds tensor '{}' would move "
                "along a path of {:.4g}, {:.4g} x its norm {:.4g} at the window's start, above "
                "spes_config.max_drift_ratio={} (window spes_config.drift_window_rounds={}); "
                "the upload is rejected", origin, changes_.size() + 1, name, path,
                path / base(t, start), start[t], sc.bounds.max_drift_ratio, sc.bounds.drift_window_rounds);
  }
}

std::vector<UpdateBounds::Outlier> UpdateBounds::outliers(
    const std::vector<std::pair<int64_t, const std::vector<double>*>>& uploads) const {
  std::vector<Outlier> out;
  const double k = cfg_.spes_config.bounds.outlier_factor;
  if (k <= 0 || uploads.size() < 2) return out;
  const std::vector<double>& now = norms_.back();
  for (const auto& [node, diff] : uploads) {
    double worst = 0;
    std::string why;
    for (size_t t : plan_.upload_of(node)) {
      if (plan_.tensors()[t].rule != Combine::Mean) continue;
      std::vector<double> others;
      for (const auto& [other, odiff] : uploads) {
        if (other == node) continue;
        const auto& up = plan_.upload_of(other);
        if (std::find(up.begin(), up.end(), t) != up.end()) others.push_back(std::sqrt((*odiff)[t]));
      }
      if (others.empty()) continue;
      // A floor far below any real update: identical nodes (all zero) compare as equal. An
      // expert averaged across nodes (fedavg, diloco) moves only on the nodes whose tokens were
      // routed to it, so an honest update may meet a median near zero: its floor is that of
      // the history check, 1e-2 x its published norm (update_history.h).
      const bool expert = plan_.tensors()[t].role == ParamRole::Expert;
      const double m = std::max(median_of(others), (expert ? 1e-2 : 1e-6) * base(t, now));
      const double d = std::sqrt((*diff)[t]);
      if (d > k * m && d / m > worst) {
        worst = d / m;
        why = fmt::format("its update of tensor '{}' has norm {:.4g}, {:.4g} x the median of the "
                          "other {} nodes' updates of it ({:.4g}), above "
                          "spes_config.outlier_factor={}; the upload is rejected", plan_.tensors()[t].name,
                          d, d / m, others.size(), m, k);
      }
    }
    if (!why.empty()) out.push_back({node, why});
  }
  return out;
}

void UpdateBounds::reset(const std::vector<torch::Tensor>& pub) {
  norms_.assign(1, norms_of(pub));
  changes_.clear();
}

nlohmann::json UpdateBounds::to_json() const {
  return {{"norms", std::vector<std::vector<double>>(norms_.begin(), norms_.end())},
          {"changes", std::vector<std::vector<double>>(changes_.begin(), changes_.end())}};
}

bool UpdateBounds::restore(const nlohmann::json& j) {
  const size_t T = plan_.tensors().size();
  const size_t W = static_cast<size_t>(cfg_.spes_config.bounds.drift_window_rounds);
  auto rows = [&](const char* key, size_t max_rows, std::deque<std::vector<double>>* out) {
    if (!j.is_object() || !j.contains(key) || !j[key].is_array() || j[key].size() > max_rows)
      return false;
    std::deque<std::vector<double>> got;
    for (const auto& r : j[key]) {
      if (!r.is_array() || r.size() != T) return false;
      std::vector<double> row;
      for (const auto& v : r) {
        if (!v.is_number()) return false;
        const double x = v.get<double>();
        if (!std::isfinite(x) || x < 0) return false;
        row.push_back(x);
      }
      got.push_back(std::move(row));
    }
    *out = std::move(got);
    return true;
  };
  std::deque<std::vector<double>> norms, changes;
  if (!rows("norms", W, &norms) || !rows("changes", W - 1, &changes) || norms.empty() ||
      changes.size() + 1 != norms.size())
    return false;
  norms_ = std::move(norms);
  changes_ = std::move(changes);
  return true;
}

void UpdateBounds::published(const std::vector<double>& change,
                             const std::vector<torch::Tensor>& pub) {
  const size_t W = static_cast<size_t>(cfg_.spes_config.bounds.drift_window_rounds);
  changes_.push_back(change);
  norms_.push_back(norms_of(pub));
  while (norms_.size() > W) norms_.pop_front();
  while (changes_.size() + 1 > W) changes_.pop_front();
}

}  // namespace spes::sync
