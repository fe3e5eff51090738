// Checkpoints: one directory per checkpoint holding model.safetensors (every weight),
// optimizer.safetensors (AdamW moments of the trainable tensors), config.yaml and state.json
// (step, data position, sync round, tokens, checksums of the two tensor files). Written into
// a temporary directory, fsynced and renamed, so a crash never leaves a half-written checkpoint;
// loading verifies the checksums.
#pragma once
#include <nlohmann/json.hpp>

#include <optional>
#include <string>

#include "spes/data/loader.h"
#include "spes/model/registry.h"
#include "spes/train/optimizer.h"

namespace spes {

struct TrainState {
  int64_t step = 0;            // optimizer steps completed
  int64_t tokens = 0;          // training tokens consumed
  LoaderState loader;          // training data position
  int64_t sync_round = 0;      // last sync round applied (SPES nodes)
  nlohmann::json extra;        // owner-defined state (e.g. the sync client's)
  // The expert ownership map in force and its epoch (issue 38; 0: the config's). A trainer
  // keeps `ownership` equal to its map and writes both into state.json ("ownership"); resumed,
  // it builds its model with that map, not the config's. Absent in older checkpoints.
  int64_t ownership_epoch = 0;
  std::optional<Ownership> ownership;
};

// Writes DIR atomically. `optimizer` may be null (weights-only export). The tokenizer kept with
// the weights is `tokenizer_file` when given, else the one cfg.data names (if any).
void checkpoint_save(const std::string& dir, const Config& cfg, const ParamRegistry& registry,
                     const AdamW* optimizer, const TrainState& state,
                     const std::string& tokenizer_file = "");
// Before a run uses checkpoint DIR: takes back a checkpoint whose replacement a kill cut short
// (io/files.h, dir_commit_recover) and removes the partial DIR.tmp.PID of processes that no
// longer run; each with a log line.
void checkpoint_tidy(const std::string& dir);
// Loads weights into the registry's tensors (names and shapes must match) and, when given,
// the optimizer moments. Returns the saved state.
TrainState checkpoint_load(const std::string& dir, const ParamRegistry& registry,
                           AdamW* optimizer);
// The ownership map a checkpoint recorded and its epoch (nullopt: none, an older checkpoint),
// checked (Ownership::from_table) and, when layers >= 0, against a model of `layers` x
// `experts` experts; throws naming the checkpoint otherwise.
std::optional<std::pair<int64_t, Ownership>> checkpoint_ownership(const std::string& dir,
                                                                  int64_t layers = -1,
                                                                  int64_t experts = 0);
// The config stored in a checkpoint.
Config checkpoint_config(const std::string& dir);
// Copies named tensors into the registry's tensors, checking names, shapes and finiteness.
// `require_all`: every registry tensor must be present.
void registry_load_tensors(const ParamRegistry& registry, const NamedTensors& tensors,
                           bool require_all, const std::string& origin);
// The whole model as named tensors in registry order.
NamedTensors registry_tensors(const ParamRegistry& registry);

}  // namespace spes
