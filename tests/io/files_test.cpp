// File helpers of io/files.h that the sync server's persistence relies on: a large file
// written past the page cache (O_DIRECT, padded and cut back, or the page cache where the file
// system refuses it) holds exactly the pieces given, in any sizes, and its head can be amended
// before it is synced; an atomic replacement keeps the replaced file aside under the name asked
// for.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "data/data_test_util.h"
#include "spes/io/files.h"

using namespace spes;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

namespace {

std::string random_bytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(gen());
  return s;
}

// Writes `data` in pieces of the given sizes (cycled) with file_write_direct.
void write_in_pieces(const std::string& path, const std::string& data,
                     const std::vector<size_t>& sizes) {
  size_t off = 0, k = 0;
  file_write_direct(path, [&](std::string* buf) {
    const size_t n = std::min(sizes[k++ % sizes.size()], data.size() - off);
    buf->append(data, off, n);
    off += n;
  });
}

// The folders to try: the test's (usually a disk file system) and /dev/shm (tmpfs) if there.
std::vector<std::string> folders(const spes::test::TempDir& tmp) {
  std::vector<std::string> out{tmp.path.string()};
  std::error_code ec;
  if (fs::is_directory("/dev/shm", ec)) {
    const fs::path shm = fs::path("/dev/shm") / tmp.path.filename();
    fs::create_directories(shm, ec);
    if (!ec) out.push_back(shm.string());
  }
  return out;
}

}  // namespace

TEST(FileWriteDirect, HoldsExactlyThePiecesWhateverTheirSizes) {
  spes::test::TempDir tmp;
  for (const std::string& dir : folders(tmp)) {
    for (const size_t total : {size_t{0}, size_t{1}, size_t{4095}, size_t{4096}, size_t{4097},
                               size_t{(3u << 20) + 5}}) {
      SCOPED_TRACE(dir + ", " + std::to_string(total) + " bytes");
      const std::string data = random_bytes(total, static_cast<uint32_t>(total) + 7);
      const std::string path = dir + "/f.bin";
      // Whole 4 MiB pieces, and uneven ones that leave every piece unaligned.
      write_in_pieces(path, data, {4u << 20});
      EXPECT_TRUE(file_read(path) == data);
      write_in_pieces(path, data, {1000, 5000, 4096, 1});
      EXPECT_TRUE(file_read(path) == data);
    }
    // Writing over a longer file leaves only the new bytes.
    const std::string path = dir + "/g.bin";
    write_in_pieces(path, random_bytes(100000, 1), {4096});
    const std::string shorter = random_bytes(5000, 2);
    write_in_pieces(path, shorter, {3000});
    EXPECT_EQ(file_read(path), shorter);
    std::error_code ec;
    if (dir != tmp.path.string()) fs::remove_all(dir, ec);
  }
}

TEST(FileWriteDirect, AmendsItsHeadBeforeTheSync) {
  spes::test::TempDir tmp;
  for (const std::string& dir : folders(tmp)) {
    for (const size_t total : {size_t{100}, size_t{4096}, size_t{4097}, size_t{(1u << 20) + 9}}) {
      SCOPED_TRACE(dir + ", " + std::to_string(total) + " bytes");
      std::string data = random_bytes(total, static_cast<uint32_t>(total));
      data.replace(40, 8, "00000000");  // a placeholder in the head
      const std::string path = dir + "/h.bin";
      size_t off = 0;
      size_t seen = 0;
      file_write_direct(
          path,
          [&](std::string* buf) {
            const size_t n = std::min<size_t>(3000, data.size() - off);
            buf->append(data, off, n);
            off += n;
          },
          [&](std::string* head) {
            seen = head->size();
            ASSERT_EQ(head->substr(40, 8), "00000000");
            head->replace(40, 8, "digest!!");
          });
      EXPECT_EQ(seen, std::min<size_t>(total, 4096));
      std::string want = data;
      want.replace(40, 8, "digest!!");
      EXPECT_TRUE(file_read(path) == want);
      EXPECT_EQ(fs::file_size(path), total);
    }
    std::error_code ec;
    if (dir != tmp.path.string()) fs::remove_all(dir, ec);
  }
}

TEST(FileWriteDirect, NamesTheFileItCannotCreate) {
  spes::test::TempDir tmp;
  const std::string path = tmp.file("no/such/dir/f.bin");
  try {
    file_write_direct(path, [](std::string*) {});
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot create '" + path + "'"));
  }
}

TEST(FileReplace, KeepsTheReplacedFileAsideAndRenamesWhenThereIsNone) {
  spes::test::TempDir tmp;
  const std::string to = tmp.file("published"), from = tmp.file("published.tmp"),
                    aside = tmp.file("published.old");
  spes::test::write_bytes(from, "first");
  EXPECT_FALSE(file_replace(from, to, aside));  // nothing to replace
  EXPECT_EQ(file_read(to), "first");
  EXPECT_FALSE(fs::exists(from));
  EXPECT_FALSE(fs::exists(aside));
  spes::test::write_bytes(from, "second");
  EXPECT_TRUE(file_replace(from, to, aside));
  EXPECT_EQ(file_read(to), "second");
  EXPECT_EQ(file_read(aside), "first");
  EXPECT_FALSE(fs::exists(from));
  // A missing source is an error that names it; the target is untouched.
  EXPECT_THROW(file_replace(tmp.file("absent"), to, aside), std::exception);
  EXPECT_EQ(file_read(to), "second");
}
