// Command-line options that mean the same in several subcommands, declared once with one help
// text: --set (config overrides: train, node, launch, serve, config, aggregate), and the
// options of the commands that train (--resume, --progress, --nproc-per-node: train, node).
// Options whose meaning differs per command (--config, --out) stay with their command.
#pragma once
#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace spes::cli {

// --set KEY=VALUE, repeatable; `applies_to` says where the overrides go (e.g. "every part").
inline void add_set_option(CLI::App& sub, std::vector<std::string>& sets,
                           const std::string& applies_to = "") {
  sub.add_option("--set", sets,
                 "Override a config key: --set model.d_model=512 (repeatable" +
                     (applies_to.empty() ? std::string() : "; applies to " + applies_to) + ")");
}

// --resume, --progress and --nproc-per-node of a command that trains; `ranks` says what the
// processes of one node share (e.g. "the global batch is split").
inline void add_training_options(CLI::App& sub, std::string& resume, std::string& progress,
                                 int64_t& nproc, const std::string& ranks) {
  sub.add_option("--resume", resume,
                 "Checkpoint to resume from: auto (OUT/checkpoint if present), none, or a dir");
  sub.add_option("--progress", progress, "Progress display: auto, bar, lines or none");
  sub.add_option("--nproc-per-node", nproc,
                 "Processes for this node, data parallel over torch.distributed: one per GPU "
                 "(NCCL), or on CPU sharing the cores (Gloo); " + ranks)
      ->check(CLI::Range(int64_t{1}, int64_t{1024}));
}

}  // namespace spes::cli
