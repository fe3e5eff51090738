// Test fault injection for nodes (see faults.h).
#include "spes/sync/node/faults.h"

#include <cstdlib>
#include <sstream>

#include "spes/common/error.h"

namespace spes::sync {

bool NodeFaults::any() const {
  return nan_round >= 0 || foreign_round >= 0 || scaled_round >= 0 || corrupt_round >= 0 ||
         stall_round >= 0 || replay_round >= 0 || cut_round >= 0 || dup_round >= 0;
}

NodeFaults parse_node_faults(const std::string& spec) {
  NodeFaults f;
  std::stringstream ss(spec);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    const size_t at = item.find('@');
    SPES_CHECK(at != std::string::npos, "SPES_SYNC_FAULTS: '{}' is not KIND@ROUND", item);
    const std::string kind = item.substr(0, at);
    std::string rest = item.substr(at + 1);
    double seconds = 0;
    if (kind == "stall") {
      const size_t colon = rest.find(':');
      SPES_CHECK(colon != std::string::npos, "SPES_SYNC_FAULTS: '{}' needs stall@ROUND:SECONDS",
                 item);
      seconds = std::stod(rest.substr(colon + 1));
      rest = rest.substr(0, colon);
    }
    int64_t round = -1;
    try {
      round = std::stoll(rest);
    } catch (const std::exception&) {
      fail("SPES_SYNC_FAULTS: '{}': the round is not a number", item);
    }
    if (kind == "nan") f.nan_round = round;
    else if (kind == "foreign") f.foreign_round = round;
    else if (kind == "scaled") f.scaled_round = round;
    else if (kind == "corrupt") f.corrupt_round = round;
    else if (kind == "replay") f.replay_round = round;
    else if (kind == "cut") f.cut_round = round;
    else if (kind == "dup") f.dup_round = round;
    else if (kind == "stall") {
      f.stall_round = round;
      f.stall_s = seconds;
    } else {
      fail("SPES_SYNC_FAULTS: unknown fault '{}' (nan, foreign, scaled, corrupt, stall, replay, "
           "cut, dup)",
           kind);
    }
  }
  return f;
}

NodeFaults node_faults_from_env() {
  const char* e = std::getenv("SPES_SYNC_FAULTS");
  return e ? parse_node_faults(e) : NodeFaults();
}

}  // namespace spes::sync
