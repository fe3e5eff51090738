// The layout of every directory a run writes, in one place, so that writers and readers
// (trainer, checkpoints, sync server, local cluster, reports) cannot disagree about a name:
//   training run (`spes train --out`, `spes node --out`): metrics.jsonl, checkpoint/
//   checkpoint: state.json (written last: marks a complete checkpoint), config.yaml, weights
//   sync server (`spes serve --out`): state.json, published.safetensors, rounds.jsonl,
//     server.json, drift_window.json, delta.safetensors (compression),
//     residual.safetensors (topk), momentum-<r>.safetensors,
//     staging/, rounds/<r>/ (--keep-uploads)
//   local cluster (`spes launch --out`): config.yaml, summary.json, server/ (a sync server's
//     directory), node<i>/ (training runs)
// Only names; reading and writing them is the business of each owner.
#pragma once
#include <fmt/format.h>

#include <cstdint>
#include <string>

namespace spes::run_layout {

// A training run's directory.
inline std::string metrics(const std::string& run) { return run + "/metrics.jsonl"; }
inline std::string checkpoint(const std::string& run) { return run + "/checkpoint"; }

// A checkpoint directory (also recognises a checkpoint among other model directories).
inline std::string checkpoint_state(const std::string& ckpt) { return ckpt + "/state.json"; }
inline std::string checkpoint_config(const std::string& ckpt) { return ckpt + "/config.yaml"; }

// A sync server's directory.
inline constexpr const char* kServerStateName = "state.json";
inline constexpr const char* kPublishedName = "published.safetensors";
inline constexpr const char* kRoundsLogName = "rounds.jsonl";
inline std::string server_state(const std::string& dir) { return dir + "/" + kServerStateName; }
inline std::string published(const std::string& dir) { return dir + "/" + kPublishedName; }
// With compression: the latest published round's delta from the round before it.
inline std::string published_delta(const std::string& dir) { return dir + "/delta.safetensors"; }
// With compression: topk: the server's residual of the published change after the latest
// published round (round/sparse_publication.h).
inline std::string sparse_residual(const std::string& dir) {
  return dir + "/residual.safetensors";
}
inline std::string rounds_log(const std::string& dir) { return dir + "/" + kRoundsLogName; }
// The server's ownership epochs (sync/server/ownership_epochs).
inline std::string ownership_epochs(const std::string& dir) { return dir + "/ownership.json"; }
inline std::string server_info(const std::string& dir) { return dir + "/server.json"; }
inline std::string drift_window(const std::string& dir) { return dir + "/drift_window.json"; }
inline std::string staging(const std::string& dir) { return dir + "/staging"; }
inline std::string kept_rounds(const std::string& dir) { return dir + "/rounds"; }
inline std::string kept_round(const std::string& dir, int64_t round) {
  return fmt::format("{}/rounds/{}", dir, round);
}
inline std::string momentum(const std::string& dir, int64_t round) {
  return fmt::format("{}/momentum-{}.safetensors", dir, round);
}
inline std::string staged_upload(const std::string& dir, int64_t round, int64_t node) {
  return fmt::format("{}/staging/round{}.node{}.safetensors", dir, round, node);
}
// What --keep-uploads keeps of round r: every upload, the published model, diloco's momentum,
// topk's residual.
inline std::string kept_upload(const std::string& dir, int64_t round, int64_t node) {
  return fmt::format("{}/node{}.safetensors", kept_round(dir, round), node);
}
inline std::string kept_published(const std::string& dir, int64_t round) {
  return kept_round(dir, round) + "/" + kPublishedName;
}
inline std::string kept_momentum(const std::string& dir, int64_t round) {
  return kept_round(dir, round) + "/momentum.safetensors";
}
inline std::string kept_residual(const std::string& dir, int64_t round) {
  return kept_round(dir, round) + "/residual.safetensors";
}

// A local cluster's directory (and its copy of the config).
inline std::string cluster_config(const std::string& dir) { return dir + "/config.yaml"; }
inline std::string cluster_summary(const std::string& dir) { return dir + "/summary.json"; }
inline std::string cluster_server(const std::string& dir) { return dir + "/server"; }
inline std::string cluster_node(const std::string& dir, int64_t node) {
  return fmt::format("{}/node{}", dir, node);
}

}  // namespace spes::run_layout
