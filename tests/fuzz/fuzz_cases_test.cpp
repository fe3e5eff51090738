// Replays every kept fuzz input through the fuzz targets' entry functions (fuzz_entries.h):
// the seed corpora (tests/fuzz/corpus/<target>/; round_rpc_int8 uses round_rpc's) and the cases
// (tests/fuzz/cases/<target>/: inputs that crashed or misbehaved before a fix, and other
// interesting ones). Each must be accepted or refused with a clean spes::Error, never crash or
// throw anything else. Runs in the normal build (CTest, CI) without clang; scripts/fuzz.sh finds
// new cases.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "fuzz/fuzz_entries.h"

namespace fs = std::filesystem;

namespace {

class FuzzCases : public ::testing::TestWithParam<std::string> {};

TEST_P(FuzzCases, EveryKeptInputIsAcceptedOrCleanlyRefused) {
  const std::string target = GetParam();
  size_t count = 0;
  // round_rpc_int8 reads round_rpc's records: it replays round_rpc's seeds and its own cases.
  const std::string seeds = target == "round_rpc_int8" ? "round_rpc" : target;
  for (const char* kind : {"corpus", "cases"}) {
    const fs::path dir = fs::path(SPES_SOURCE_DIR) / "tests" / "fuzz" / kind /
                         (std::string(kind) == "corpus" ? seeds : target);
    if (!fs::exists(dir)) continue;
    for (const auto& e : fs::directory_iterator(dir)) {
      std::ifstream in(e.path(), std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
      EXPECT_NO_THROW(spes::fuzz::fuzz_run(
          target, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()))
          << e.path();
      ++count;
    }
  }
  EXPECT_GE(count, 3u) << "tests/fuzz/{corpus,cases}/" << target << " hold too few inputs";
}

INSTANTIATE_TEST_SUITE_P(Targets, FuzzCases,
                         ::testing::ValuesIn(spes::fuzz::fuzz_target_names()),
                         [](const auto& info) { return info.param; });

}  // namespace
