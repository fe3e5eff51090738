// A scripted disruption of a local cluster (see launch_disruption.h).
#include "spes/cluster/launch_disruption.h"

#include <chrono>
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "spes/common/error.h"
#include "spes/io/files.h"
#include "spes/io/run_layout.h"

namespace spes {

std::string NodeDisruption::describe() const {
  switch (kind) {
    case Kind::Kill:
      return fmt::format("node {} killed (SIGKILL) after round {}", node, at_round);
    case Kind::Depart:
      return fmt::format("node {} departing (SIGTERM, --depart) after round {}", node, at_round);
    case Kind::None:
      break;
  }
  return "no disruption";
}

void NodeDisruption::check(int64_t nodes, int64_t rounds) const {
  if (!active()) return;
  SPES_CHECK(node >= 0 && node < nodes, "--kill-node/--depart-node {}: the cluster has nodes 0 "
             "to {}; name one of them", node, nodes - 1);
  SPES_CHECK(at_round >= 1 && at_round < rounds, "--at-round {}: the run has rounds 1 to {} "
             "(max_duration / spes_config.sync_steps); name one before the last, so that the "
             "others run on without node {}", at_round, rounds, node);
}

std::string NodeArrival::describe() const {
  return fmt::format("node {} joins (--join-new) after round {}", node, after_round);
}

void NodeArrival::check(int64_t rounds) const {
  if (!active()) return;
  SPES_CHECK(after_round < rounds, "--add-node-at-round {}: the run has rounds 1 to {} "
             "(max_duration / spes_config.sync_steps); name one before the last, so that node {} "
             "has rounds to train in", after_round, rounds, node);
}

RoundWatch::RoundWatch(std::string server_dir, int64_t at_round)
    : server_dir_(std::move(server_dir)), at_round_(at_round) {}

bool RoundWatch::due() {
  if (at_round_ <= 0 || fired_) return false;
  const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::steady_clock::now().time_since_epoch())
                             .count();
  if (now_ms - last_check_ms_ < 200) return false;
  last_check_ms_ = now_ms;
  fired_ = published_round_of(server_dir_) >= at_round_;
  return fired_;
}

int64_t published_round_of(const std::string& server_dir) {
  const std::string path = run_layout::server_state(server_dir);
  try {
    if (!std::filesystem::exists(path)) return 0;
    return nlohmann::json::parse(file_read(path)).value("round", int64_t{0});
  } catch (const std::exception&) {
    return 0;  // unreadable (another format, damaged): nothing known to be published
  }
}

}  // namespace spes
