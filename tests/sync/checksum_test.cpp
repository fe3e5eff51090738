// Transport checksums (src/spes/sync/wire/checksum.h) against python-xxhash from PyPI
// (tests/sync/xxh3_reference.py): whole buffers of the lengths where XXH3's code paths change
// (0, 1-3, 4-8, 9-16, 17-128, 129-240, longer, several stripes and blocks), the same bytes fed
// to StreamChecksum in uneven pieces, and the file checksum the server uses on staged uploads.
#include <gtest/gtest.h>

#include <random>
#include <sstream>

#include "python_reference.h"
#include "spes/io/files.h"
#include "spes/sync/wire/checksum.h"
#include "spes/sync/wire/protocol.h"
#include "sync/sync_test_util.h"

namespace spes::sync {
namespace {

TEST(TransportChecksum, MatchesPythonXxhashWholeStreamedAndFromAFile) {
  testing::TempDir dir;
  std::mt19937_64 rng(7);
  const std::vector<size_t> lengths = {0,   1,   3,    4,    8,    9,     16,     17,
                                       128, 129, 240,  241,  1024, 4096,  65537,
                                       (2u << 20) + 7};
  std::vector<std::string> data, files;
  for (size_t n : lengths) {
    std::string s(n, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    files.push_back(dir.path + "/b" + std::to_string(n));
    file_write_atomic(files.back(), s);
    data.push_back(std::move(s));
  }
  std::istringstream want(test::run_python_reference("sync/xxh3_reference.py", files));
  for (size_t i = 0; i < data.size(); ++i) {
    std::string ref;
    ASSERT_TRUE(std::getline(want, ref)) << "the reference printed too few lines";
    ASSERT_EQ(ref.size(), 32u);
    EXPECT_EQ(chunk_checksum(data[i]), ref) << data[i].size() << " bytes";
    StreamChecksum h;
    size_t at = 0;
    while (at < data[i].size()) {
      const size_t piece = std::min<size_t>(data[i].size() - at, 1 + rng() % 70000);
      h.update(data[i].data() + at, piece);
      at += piece;
    }
    EXPECT_EQ(h.hex_digest(), ref) << data[i].size() << " bytes fed in pieces";
    EXPECT_EQ(file_checksum(files[i]), ref) << files[i];
  }
}

TEST(TransportChecksum, OneFlippedBitChangesItAndAMissingFileIsNamed) {
  std::string s(1000, 'x');
  const std::string before = chunk_checksum(s);
  s[500] ^= 1;
  EXPECT_NE(chunk_checksum(s), before);
  try {
    file_checksum("/nonexistent/staged.partial");
    FAIL() << "no error";
  } catch (const SyncError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/staged.partial"), std::string::npos);
  }
}

}  // namespace
}  // namespace spes::sync
