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

struct SubcommandInfo {
  std::string name;
  std::string description;
  SubcommandSetup setup;
};

std::vector<SubcommandInfo>& subcommand_list();

struct SubcommandRegistrar {
  SubcommandRegistrar(std::string name, std::string description, SubcommandSetup setup) {
    subcommand_list().push_back({std::move(name), std::move(description), std::move(setup)});
  }
};

}  // namespace spes::cli
