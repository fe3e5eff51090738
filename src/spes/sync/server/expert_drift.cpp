// The run-long per-expert bound: against the layer's other experts and the expert's own start
// (see expert_drift.h).
#include "spes/sync/server/expert_drift.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "spes/sync/wire/protocol.h"

namespace spes::sync {

namespace {
// What an expert tensor is within its expert ("up_proj.weight"), so that the same tensor of
// the layer's other experts can be found.
std::string projection_of(const PlanTensor& t) {
  const std::string prefix = fmt::format("model.layers.{}.mlp.experts.{}.", t.layer, t.expert);
  return t.name.rfind(prefix, 0) == 0 ? t.name.substr(prefix.size()) : t.name;
}
}  // namespace

ExpertDrift::ExpertDrift(const Config& cfg, const RoundPlan& plan,
                         const std::vector<torch::Tensor>& pub)
    : cfg_(cfg), plan_(plan) {
  const auto& ts = plan_.tensors();
  floor_.resize(ts.size());
  start_.assign(ts.size(), -1.0);
  now_.assign(ts.size(), 0.0);
  peers_.resize(ts.size());
  std::map<std::pair<int64_t, std::string>, std::vector<size_t>> groups;
  for (size_t t = 0; t < ts.size(); ++t) {
    floor_[t] = 1e-3 * std::sqrt(static_cast<double>(pub[t].numel()));
    now_[t] = pub[t].norm().item<double>();
    if (ts[t].role != ParamRole::Expert) continue;
    start_[t] = now_[t];
    groups[{ts[t].layer, projection_of(ts[t])}].push_back(t);
  }
  for (const auto& [key, members] : groups)
    for (size_t t : members)
      for (size_t o : members)
        if (o != t) peers_[t].push_back(o);
}

void ExpertDrift::check_upload(int64_t node, const std::vector<double>& norm_sq,
                               const std::string& origin) {
  std::lock_guard<std::mutex> lk(mu_);
  // Every expert of the upload that breaks a bound is flagged; the first is named.
  std::string first;
  for (size_t t : plan_.upload_of(node)) {
    if (start_[t] < 0) continue;
    const std::string why = breach(t, std::sqrt(norm_sq[t]));
    if (why.empty()) continue;
    const PlanTensor& pt = plan_.tensors()[t];
    if (flagged_.insert({pt.layer, pt.expert}).second)
      spdlog::warn("{}: expert {} of layer {} is flagged for the rest of the run: merging no "
                   "longer takes from it", origin, pt.expert, pt.layer);
    if (first.empty()) first = why;
  }
  if (!first.empty())
    sync_fail(SyncErrc::InvalidArgument, "{}: {}; the upload is rejected and the expert flagged "
              "(merging no longer takes from it)", origin, first);
}

std::string ExpertDrift::breach(size_t t, double n) const {
  const auto& b = cfg_.spes_config.bounds;
  const PlanTensor& pt = plan_.tensors()[t];
  if (b.max_expert_peer_ratio > 0 && !peers_[t].empty()) {
    std::vector<double> others;
    for (size_t o : peers_[t]) others.push_back(now_[o]);
    const double m = std::max(median_of(others), floor_[t]);
    if (n > b.max_expert_peer_ratio * m)
      return fmt::format("the norm of expert tensor '{}' would be {:.4g}, {:.4g} x the median "
                         "norm of the same tensor of the layer's {} other experts ({:.4g}), "
                         "above spes_config.max_expert_peer_ratio={}", pt.name, n, n / m,
                         others.size(), m, b.max_expert_peer_ratio);
  }
  const double s = std::max(start_[t], floor_[t]);
  if (b.max_expert_growth > 0 && n > b.max_expert_growth * s)
    return fmt::format("the norm of expert tensor '{}' would be {:.4g}, {:.4g} x its norm at the "
                       "run's start ({:.4g}), above spes_config.max_expert_growth={}", pt.name, n,
                       n / s, start_[t], b.max_expert_growth);
  return "";
}

std::set<ExpertKey> ExpertDrift::flagged() const {
  std::lock_guard<std::mutex> lk(mu_);
  return flagged_;
}

void ExpertDrift::reset(const std::vector<torch::Tensor>& pub) {
  published(pub);
  std::lock_guard<std::mutex> lk(mu_);
  for (size_t t = 0; t < start_.size(); ++t)
    if (start_[t] >= 0) start_[t] = now_[t];
  flagged_.clear();
}

void ExpertDrift::published(const std::vector<torch::Tensor>& pub) {
  std::vector<double> now(pub.size());
  for (size_t t = 0; t < pub.size(); ++t)
    now[t] = start_[t] < 0 ? 0.0 : pub[t].norm().item<double>();
  std::lock_guard<std::mutex> lk(mu_);
  now_ = std::move(now);
}

nlohmann::json ExpertDrift::to_json() const {
  std::lock_guard<std::mutex> lk(mu_);
  nlohmann::json start = nlohmann::json::object();
  const auto& ts = plan_.tensors();
  for (size_t t = 0; t < ts.size(); ++t)
    if (start_[t] >= 0) start[ts[t].name] = start_[t];
  nlohmann::json flagged = nlohmann::json::array();
  for (const auto& [layer, expert] : flagged_) flagged.push_back({layer, expert});
  return {{"start", start}, {"flagged", flagged}};
}

bool ExpertDrift::restore(const nlohmann::json& j) {
  if (!j.is_object() || !j.contains("start") || !j["start"].is_object() ||
      !j.contains("flagged") || !j["flagged"].is_array())
    return false;
  const auto& ts = plan_.tensors();
  std::vector<double> start = start_;
  std::set<ExpertKey> experts;
  for (size_t t = 0; t < ts.size(); ++t) {
    if (start_[t] < 0) continue;
    experts.insert({ts[t].layer, ts[t].expert});
    const auto it = j["start"].find(ts[t].name);
    if (it == j["start"].end() || !it->is_number()) return false;
    const double v = it->get<double>();
    if (!std::isfinite(v) || v < 0) return false;
    start[t] = v;
  }
  std::set<ExpertKey> flagged;
  for (const auto& e : j["flagged"]) {
    if (!e.is_array() || e.size() != 2 || !e[0].is_number_integer() || !e[1].is_number_integer())
      return false;
    const ExpertKey k{e[0].get<int64_t>(), e[1].get<int64_t>()};
    if (!experts.count(k)) return false;
    flagged.insert(k);
  }
  std::lock_guard<std::mutex> lk(mu_);
  start_ = std::move(start);
  flagged_ = std::move(flagged);
  return true;
}

}  // namespace spes::sync
