// Entry point of the `spes` binary: sets the heap to keep freed blocks for reuse
// (common/memory_policy.h), selects OpenBLAS's core where it fell back to generic kernels
// (common/cpu_blas.h), loads libtorch_cuda unless the subcommand never uses a GPU
// (train/cuda_library.h), builds the CLI11 app from the registered subcommands and turns
// library errors into one clear line on stderr and exit code 1 (a mistyped command too, with
// the nearest command's name).
#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <iostream>

#include "cli/command.h"
#include "spes/common/build_features.h"
#include "spes/common/cpu_blas.h"
#include "spes/common/error.h"
#include "spes/common/memory_policy.h"
#include "spes/common/strings.h"
#include "spes/train/cuda_library.h"
#include "spes/train/device.h"

namespace spes::cli {
std::vector<SubcommandInfo>& subcommand_list() {
  static std::vector<SubcommandInfo> list;
  return list;
}
std::vector<std::string>& command_line_args() {
  static std::vector<std::string> args;
  return args;
}

namespace {
// The first argument that is not an option, when it names no subcommand: a mistyped command
// ("" when there is none).
std::string unknown_command(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.empty() || a[0] == '-') continue;
    for (const auto& info : subcommand_list())
      if (info.name == a) return "";
    return a;
  }
  return "";
}

// Whether the subcommand that argv names (the first argument that is one) may use a GPU;
// --version and --help alone may (the version names the GPUs it sees).
GpuUse gpu_use_of_command(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    for (const auto& info : subcommand_list())
      if (info.name == argv[i]) return info.gpu;
  return GpuUse::May;
}
}  // namespace
}  // namespace spes::cli

int main(int argc, char** argv) {
  spes::keep_freed_heap_memory();  // before any large allocation (common/memory_policy.h)
  spes::select_cpu_blas_core();    // before any matrix product (common/cpu_blas.h)
  spes::cli::command_line_args().assign(argv + 1, argv + argc);
  // Before any torch call: libtorch decides once whether it has CUDA.
  try {
    if (spes::cli::gpu_use_of_command(argc, argv) == spes::cli::GpuUse::May)
      spes::load_torch_cuda_if_driver();
  } catch (const spes::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  CLI::App app{"spes: memory-efficient decentralized pretraining of mixture-of-experts models"};
  app.set_version_flag("--version", [] {
    return std::string("spes ") + SPES_VERSION + " (" + spes::torch_build_summary() +
           (SPES_WITH_SYNC ? "" : ", sync: no (built with SPES_WITH_SYNC=OFF)") + ")";
  });
  app.require_subcommand(1);
  app.option_defaults()->always_capture_default();
  auto& list = spes::cli::subcommand_list();
  std::sort(list.begin(), list.end(), [](auto& a, auto& b) { return a.name < b.name; });
  for (auto& info : list) {
    CLI::App* sub = app.add_subcommand(info.name, info.description);
    info.setup(*sub);
  }
  if (const std::string bad = spes::cli::unknown_command(argc, argv); !bad.empty()) {
    std::vector<std::string> names;
    for (const auto& info : list) names.push_back(info.name);
    std::cerr << "error: '" << bad << "' is not a spes command"
              << spes::suggestion_suffix(bad, names) << "; `spes --help` lists the commands\n";
    return 1;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const spes::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  } catch (const c10::Error& e) {
    std::cerr << "error: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
