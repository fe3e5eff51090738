// File helpers of io/files.h that the sync server's persistence relies on: a large file
// written past the page cache (O_DIRECT, padded and cut back, or the page cache where the file
// system refuses it) holds exactly the pieces given, in any sizes, and its head can be amended
// before it is synced; an atomic replacement keeps the replaced file aside under the name asked
// for.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "data/data_test_util.h"
#include "spes/io/files.h"
#include "spes/io/files_detail.h"

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

// Whether files in `dir` take O_DIRECT writes (an aligned block to a file opened with it).
bool direct_writes_work(const std::string& dir) {
  const std::string path = dir + "/direct_probe";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0644);
  if (fd < 0) return false;
  void* block = std::aligned_alloc(4096, 4096);
  std::memset(block, 0, 4096);
  const bool ok = ::write(fd, block, 4096) == 4096;
  std::free(block);
  ::close(fd);
  ::unlink(path.c_str());
  return ok;
}

bool is_direct(int fd) { return (::fcntl(fd, F_GETFL) & O_DIRECT) != 0; }

// file_write_direct_with `data` in pieces of `piece` bytes, its bytes 40-47 amended to
// "digest!!" before the sync.
void write_amended(const std::string& path, const std::string& data, size_t piece,
                   const spes::detail::WriteCall& write_call) {
  size_t off = 0;
  spes::detail::file_write_direct_with(
      path,
      [&](std::string* buf) {
        const size_t n = std::min(piece, data.size() - off);
        buf->append(data, off, n);
        off += n;
      },
      [](std::string* head) { head->replace(40, 8, "digest!!"); }, write_call);
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

// A file system that opens a file with O_DIRECT but refuses the direct writes (EINVAL): the
// file is written through the page cache from its start, whole and amended.
TEST(FileWriteDirect, FallsBackToThePageCacheWhenDirectWritesAreRefused) {
  spes::test::TempDir tmp;
  if (!direct_writes_work(tmp.path.string()))
    GTEST_SKIP() << "the test folder's file system does not take O_DIRECT writes at all, so the "
                    "fallback after an accepted open cannot be reached there";
  for (const size_t total : {size_t{100}, size_t{4096}, size_t{4097}, size_t{(3u << 20) + 5}}) {
    for (const size_t piece : {size_t{1000}, size_t{70000}}) {
      SCOPED_TRACE(std::to_string(total) + " bytes in pieces of " + std::to_string(piece));
      const std::string data = random_bytes(total, static_cast<uint32_t>(total + piece));
      const std::string path = tmp.file("refused.bin");
      int refused = 0, buffered = 0;
      write_amended(path, data, piece, [&](int fd, const void* d, size_t n) -> ssize_t {
        if (is_direct(fd)) {
          ++refused;
          errno = EINVAL;
          return -1;
        }
        ++buffered;
        return ::write(fd, d, n);
      });
      EXPECT_EQ(refused, 1);  // once refused, never tried again
      EXPECT_GE(buffered, 1);
      std::string want = data;
      want.replace(40, 8, "digest!!");
      EXPECT_TRUE(file_read(path) == want);
      EXPECT_EQ(fs::file_size(path), total);
    }
  }
}

// Once direct writes have put bytes in the file, a refusal is no longer a file system that
// wants another alignment: it is an error that names the file, and so is any failure other
// than EINVAL.
TEST(FileWriteDirect, OtherWriteFailuresAreErrorsThatNameTheFile) {
  spes::test::TempDir tmp;
  if (!direct_writes_work(tmp.path.string()))
    GTEST_SKIP() << "the test folder's file system does not take O_DIRECT writes";
  const std::string data = random_bytes((1u << 20) + 3, 5);
  const std::string path = tmp.file("failed.bin");
  struct Case {
    const char* what;
    int fail_at;  // the direct write that fails (0: the first)
    int err;
  };
  for (const Case c : {Case{"EINVAL after a direct write", 1, EINVAL},
                       Case{"EIO at the first write", 0, EIO},
                       Case{"ENOSPC after a direct write", 2, ENOSPC}}) {
    SCOPED_TRACE(c.what);
    int calls = 0;
    try {
      write_amended(path, data, 70000, [&](int fd, const void* d, size_t n) -> ssize_t {
        if (calls++ == c.fail_at) {
          errno = c.err;
          return -1;
        }
        EXPECT_TRUE(is_direct(fd)) << "the writer fell back to the page cache";
        return ::write(fd, d, n);
      });
      FAIL() << "expected an error";
    } catch (const std::exception& e) {
      EXPECT_THAT(e.what(), HasSubstr("cannot write '" + path + "'"));
      EXPECT_THAT(e.what(), HasSubstr(std::strerror(c.err)));
      EXPECT_THAT(e.what(), HasSubstr("disk full?"));
    }
    EXPECT_EQ(calls, c.fail_at + 1);
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
