// What a local SPES cluster run produced, read back from its files: per node the final
// validation loss, bytes up/down per round, peak RSS and the model digest after every sync;
// per round the server's line; whether every node held the published model after every round;
// and an offline re-computation of each kept round (`spes aggregate`'s code) compared byte for
// byte with what the server published. Used by `spes launch` and the end-to-end tests.
// Leaves out: plotting and cross-run comparisons (the experiment script).
#pragma once
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "spes/cluster/launch_disruption.h"
#include "spes/io/config.h"

namespace spes {

// Reads DIR/server/rounds.jsonl and DIR/node<i>/metrics.jsonl for i < nodes. The node of a
// scripted disruption (`stopped`) must report the rounds before the one it was stopped after
// (it may or may not report that one, and none later) and is marked "disrupted" (its last
// validation loss is not the run's). The node of an `arrival` (the last of `nodes`) must
// report every round after the one it joined at, none before, and is marked "arrived".
nlohmann::json cluster_report(const std::string& dir, int64_t nodes,
                              const NodeDisruption& stopped = {},
                              const NodeArrival& arrival = {});
// The report as a few human-readable lines.
std::string format_cluster_report(const nlohmann::json& report);

// For every DIR/rounds/<r>/ with kept uploads: aggregates them offline on top of
// rounds/<r-1>/published.safetensors (and momentum) and compares the result with
// rounds/<r>/published.safetensors byte for byte. {"checked", "equal", "mismatched": [...]}.
nlohmann::json verify_kept_rounds(const Config& cfg, const std::string& server_dir);

}  // namespace spes
