// Status JSON of the sync server's dashboard (see dashboard_status.h).
#include "spes/sync/server/dashboard_status.h"

#include <cmath>
#include <string>

namespace spes::sync {
namespace {

// NaN (not reported yet) as null: JSON has no NaN.
nlohmann::json number_or_null(double x) {
  return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr);
}

// The fields of a rounds.jsonl record that the page shows.
nlohmann::json round_summary(const nlohmann::json& line) {
  nlohmann::json r = nlohmann::json::object();
  for (const char* k : {"round", "step", "nodes", "missing", "bytes_in", "bytes_out", "alpha",
                        "merged", "seconds", "download_s", "gate_cos", "gate_cos_before",
                        "downloads_complete", "recovered", "ownership_epoch", "handoffs"})
    if (line.contains(k)) r[k] = line[k];
  return r;
}

}  // namespace

nlohmann::json dashboard_status(const Config& cfg, const RoundState& state, double uptime_s) {
  const ServerStatus s = state.status();
  const auto& sc = cfg.spes_config;
  nlohmann::json out = {{"run_name", cfg.run_name},
                        {"mode", sc.mode.name()},
                        {"num_peers", sc.num_peers},
                        {"sync_steps", sc.sync_steps},
                        {"transfer_dtype", sc.transfer.dtype.name()},
                        {"total_steps", cfg.total_steps()},
                        {"published_round", s.published_round},
                        {"published_step", s.published_step},
                        {"collecting_round", s.collecting_round},
                        {"round_open_s", s.round_open_s},
                        {"publish_error", s.publish_error},
                        {"ownership_epoch", s.ownership_epoch},
                        {"departed", s.departed},
                        {"frozen_experts", s.frozen_experts},
                        {"model_sha256", s.model_sha256},
                        {"uptime_s", uptime_s},
                        {"nodes", nlohmann::json::array()},
                        {"rounds", nlohmann::json::array()},
                        {"loss", nlohmann::json::object()}};
  for (const NodeState& n : s.nodes)
    out["nodes"].push_back({{"node", n.node_id},
                            {"state", n.state},
                            {"last_seen_s", n.last_seen_s < 0 ? nlohmann::json(nullptr)
                                                              : nlohmann::json(n.last_seen_s)},
                            {"step", n.step},
                            {"tokens_per_s", number_or_null(n.tokens_per_s)},
                            {"loss", number_or_null(n.loss)},
                            {"detail", n.detail}});
  for (const nlohmann::json& line : state.round_history())
    out["rounds"].push_back(round_summary(line));
  const auto curves = state.loss_history();
  for (size_t i = 0; i < curves.size(); ++i) {
    if (curves[i].empty()) continue;
    nlohmann::json pts = nlohmann::json::array();
    for (const LossPoint& p : curves[i]) pts.push_back({p.step, p.loss});
    out["loss"][std::to_string(i)] = std::move(pts);
  }
  return out;
}

}  // namespace spes::sync
