// The TensorBoard event files of a run directory read back by the `tensorboard` package from
// PyPI (tests/io/tensorboard_events.py), and the check that their scalars are a JSON-lines
// file's figures: for each (key, tag), one event per line that has the key, at the line's step
// and wall time, with the value as a float (TensorBoard's simple_value).
#pragma once
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "python_reference.h"

namespace spes::test {

// {"scalars": {tag: [[step, value, wall_time], ...]}, "files", "records", "file_version",
// "corrupt_detected"}, or {"skip": reason} without the package.
inline nlohmann::json read_tensorboard(const std::string& dir) {
  return nlohmann::json::parse(run_python_reference("io/tensorboard_events.py", {dir}));
}

inline ::testing::AssertionResult scalars_equal_lines(
    const nlohmann::json& tb, const std::vector<nlohmann::json>& lines,
    const std::vector<std::pair<std::string, std::string>>& keys) {
  for (const auto& [key, tag] : keys) {
    std::vector<std::vector<double>> want;
    for (const auto& l : lines)
      if (l.contains(key) && l[key].is_number())
        want.push_back({l["step"].get<double>(),
                        static_cast<double>(static_cast<float>(l[key].get<double>())),
                        l["time"].get<double>()});
    if (want.empty()) return ::testing::AssertionFailure() << "no line has '" << key << "'";
    if (!tb["scalars"].contains(tag))
      return ::testing::AssertionFailure() << "no scalar '" << tag << "' in " << tb.dump();
    const auto got = tb["scalars"][tag].get<std::vector<std::vector<double>>>();
    if (got != want)
      return ::testing::AssertionFailure()
             << tag << ": TensorBoard read " << nlohmann::json(got).dump() << ", the lines say "
             << nlohmann::json(want).dump();
  }
  return ::testing::AssertionSuccess();
}

}  // namespace spes::test
