// The JSON behind the sync server's dashboard (GET /api/status, read by
// src/spes/dashboard/dashboard_page.html), built from the server's real state: the run's
// settings, every node (state, seconds since its last call, step, tokens/s and loss from its
// heartbeats), the recent published rounds from their rounds.jsonl records (nodes used, who
// was missing and why, bytes in and out, alpha, duration, per-layer expert similarity
// `gate_cos`) and each node's loss curve. Leaves out: HTTP (dashboard/dashboard_server.h).
#pragma once
#include <nlohmann/json.hpp>

#include "spes/io/config.h"
#include "spes/sync/server/round_state.h"

namespace spes::sync {

nlohmann::json dashboard_status(const Config& cfg, const RoundState& state, double uptime_s);

}  // namespace spes::sync
