// Subcommand registration: each cmd_*.cpp defines a static SubcommandRegistrar that adds its
// CLI11 subcommand to the `spes` app, so main.cpp never needs to know the list.
#pragma once
#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace spes::cli {

// `setup` declares the options on `sub` and sets its callback.
using SubcommandSetup = std::function<void(CLI::App& sub)>;

// Whether a subcommand may run a model on a GPU. Only those load libtorch_cuda at start (where
// the machine has an NVIDIA driver, train/cuda_library.h); the others (the sync server, the
// data and file tools) never map the CUDA libraries.
enum class GpuUse { May, Never };

struct SubcommandInfo {
  std::string name;
  std::string description;
  SubcommandSetup setup;
  GpuUse gpu = GpuUse::May;
};

std::vector<SubcommandInfo>& subcommand_list();

// The arguments this process was started with, without the executable (set by main); the
// rank launcher starts the ranks of `--nproc-per-node` with them.
std::vector<std::string>& command_line_args();

// Ends the subcommand with this exit code (main returns it without printing anything).
[[noreturn]] inline void exit_with(int code) { throw CLI::RuntimeError(code); }

struct SubcommandRegistrar {
  SubcommandRegistrar(std::string name, std::string description, SubcommandSetup setup,
                      GpuUse gpu = GpuUse::May) {
    subcommand_list().push_back({std::move(name), std::move(description), std::move(setup), gpu});
  }
};

}  // namespace spes::cli
