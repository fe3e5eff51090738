// Entry point of the `spes` binary: builds the CLI11 app from the registered subcommands and
// turns library errors into one clear line on stderr and exit code 1. Every model it starts
// honours model.init_checkpoint (the reader that interop/init_checkpoint.h installs).
#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <iostream>

#include "cli/command.h"
#include "spes/common/build_features.h"
#include "spes/common/error.h"
#include "spes/interop/init_checkpoint.h"
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
}  // namespace spes::cli

int main(int argc, char** argv) {
  spes::cli::command_line_args().assign(argv + 1, argv + argc);
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
