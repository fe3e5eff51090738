// File helpers (see files.h).
#include "spes/io/files.h"
#include "spes/io/files_detail.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <openssl/sha.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "spes/common/error.h"

namespace spes {
namespace fs = std::filesystem;

std::string file_read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  SPES_CHECK(f.good(), "cannot read '{}' (does it exist?)", path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}
ReadFile ReadFile::try_open(const std::string& path) {
  return ReadFile(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
}

ReadFile ReadFile::open(const std::string& path) {
  ReadFile f = try_open(path);
  SPES_CHECK(f, "cannot open '{}' for reading: {}", path, std::strerror(errno));
  return f;
}

ReadFile::~ReadFile() {
  if (fd_ >= 0) ::close(fd_);
}

void file_pread_exact(int fd, void* dst, uint64_t n, uint64_t offset, const std::string& what) {
  uint64_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(fd, static_cast<char*>(dst) + got, n - got,
                              static_cast<off_t>(offset + got));
    if (r < 0 && errno == EINTR) continue;
    SPES_CHECK(r > 0, "cannot read {} ({})", what, r == 0 ? "truncated" : std::strerror(errno));
    got += static_cast<uint64_t>(r);
  }
}


std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    try {
      out.push_back(nlohmann::json::parse(line));
    } catch (const nlohmann::json::exception&) {
      // A line being written when the run stopped: ignore it.
    }
  }
  return out;
}

static void fsync_fd_path(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

void dir_fsync(const std::string& dir) { fsync_fd_path(dir.empty() ? "." : dir, O_RDONLY); }

void file_write_atomic(const std::string& path, const std::string& data) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  SPES_CHECK(fd >= 0, "cannot create '{}': {}", tmp, std::strerror(errno));
  size_t off = 0;
  while (off < data.size()) {
    ssize_t w = ::write(fd, data.data() + off, data.size() - off);
    if (w < 0) {
      int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      fail("cannot write '{}': {}", tmp, std::strerror(e));
    }
    off += static_cast<size_t>(w);
  }
  // A file is only renamed into place once it is known to be on disk.
  const int sync_err = ::fsync(fd) == 0 ? 0 : errno;
  const int close_err = ::close(fd) == 0 ? 0 : errno;
  if (sync_err != 0 || close_err != 0) {
    ::unlink(tmp.c_str());
    fail("cannot write '{}': {}", tmp, std::strerror(sync_err != 0 ? sync_err : close_err));
  }
  SPES_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename '{}' to '{}': {}", tmp,
             path, std::strerror(errno));
  dir_fsync(fs::path(path).parent_path().string());
}

namespace {
constexpr size_t kDirectAlign = 4096;  // buffer, offset and length alignment of O_DIRECT

// Writes [data, data + n) at the file's position through `write_call`; false with errno set on
// error.
bool write_all(const detail::WriteCall& write_call, int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t w = write_call(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      if (w == 0) errno = EIO;
      return false;
    }
    data += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}
}  // namespace

void file_write_direct(const std::string& path,
                       const std::function<void(std::string* buf)>& next,
                       const std::function<void(std::string* head)>& amend_head) {
  detail::file_write_direct_with(path, next, amend_head, [](int fd, const void* data, size_t n) {
    return ::write(fd, data, n);
  });
}

void detail::file_write_direct_with(const std::string& path,
                                    const std::function<void(std::string* buf)>& next,
                                    const std::function<void(std::string* head)>& amend_head,
                                    const WriteCall& write_call) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0644);
  bool direct = fd >= 0;
  if (!direct) fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  SPES_CHECK(fd >= 0, "cannot create '{}': {}", path, std::strerror(errno));
  struct Closer {  // closes the file on every way out (next() and amend_head may throw)
    int& fd;
    ~Closer() {
      if (fd >= 0) ::close(fd);
    }
  } closer{fd};
  // O_DIRECT takes whole blocks from an aligned buffer at aligned offsets: the pieces are
  // gathered in `block` and written a whole number of blocks at a time; the tail is padded
  // with zeros and the file cut back to its size at the end.
  std::unique_ptr<char, decltype(&std::free)> block(nullptr, &std::free);
  size_t capacity = 0, held = 0;
  auto failed = [&](const char* what) {
    const int e = errno;
    fail("cannot {} '{}': {} (disk full? free space there and retry)", what, path,
         std::strerror(e));
  };
  // Writes the whole blocks of `block` (all of it, padded, when `last`), keeping the rest;
  // false (errno set, nothing kept changed) when the write fails.
  auto flush_blocks = [&](bool last) {
    const size_t whole = last ? (held + kDirectAlign - 1) / kDirectAlign * kDirectAlign
                              : held / kDirectAlign * kDirectAlign;
    if (whole == 0) return true;
    std::memset(block.get() + held, 0, whole - std::min(whole, held));
    if (!write_all(write_call, fd, block.get(), whole)) return false;
    held -= std::min(whole, held);
    std::memmove(block.get(), block.get() + whole, held);
    return true;
  };
  std::string piece, head;
  uint64_t total = 0;
  // After a failed direct write: EINVAL before anything was written means this file system
  // wants another alignment; go on through the page cache from the start (`block` holds
  // everything so far). Any other failure is an error.
  auto fall_back = [&] {
    if (errno != EINVAL || held != total) failed("write");
    direct = false;
    if (::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_DIRECT) != 0 ||
        ::lseek(fd, 0, SEEK_SET) != 0 || !write_all(write_call, fd, block.get(), held))
      failed("write");
    held = 0;
  };
  for (;;) {
    piece.clear();
    next(&piece);
    if (piece.empty()) break;
    if (amend_head && head.size() < kDirectAlign)
      head.append(piece, 0, std::min(piece.size(), kDirectAlign - head.size()));
    total += piece.size();
    if (direct) {
      if (held + piece.size() + kDirectAlign > capacity) {
        capacity = (held + piece.size() + 2 * kDirectAlign) / kDirectAlign * kDirectAlign;
        std::unique_ptr<char, decltype(&std::free)> bigger(
            static_cast<char*>(std::aligned_alloc(kDirectAlign, capacity)), &std::free);
        SPES_CHECK(bigger, "out of memory writing '{}'", path);
        if (held) std::memcpy(bigger.get(), block.get(), held);
        block = std::move(bigger);
      }
      std::memcpy(block.get() + held, piece.data(), piece.size());
      held += piece.size();
      if (!flush_blocks(false)) fall_back();
      continue;
    }
    if (!write_all(write_call, fd, piece.data(), piece.size())) failed("write");
  }
  if (direct && !flush_blocks(true)) fall_back();
  if (amend_head && !head.empty()) {
    const size_t n = head.size();
    amend_head(&head);
    SPES_CHECK(head.size() == n, "'{}': the amended head changed length ({} -> {} bytes)", path,
               n, head.size());
    // Direct: one aligned block at offset 0 (past the end of a file shorter than a block,
    // the padding is cut off below).
    const char* src = head.data();
    size_t len = n;
    if (direct) {
      std::memcpy(block.get(), head.data(), n);
      std::memset(block.get() + n, 0, kDirectAlign - n);
      src = block.get();
      len = kDirectAlign;
    }
    for (size_t done = 0; done < len;) {
      const ssize_t w = ::pwrite(fd, src + done, len - done, static_cast<off_t>(done));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) failed("write");
      done += static_cast<size_t>(w);
    }
  }
  if (::ftruncate(fd, static_cast<off_t>(total)) != 0) failed("write");
  if (::fsync(fd) != 0) failed("sync");
  const int done = fd;
  fd = -1;
  if (::close(done) != 0) fail("cannot write '{}': {} (disk full?)", path, std::strerror(errno));
}

bool file_replace(const std::string& from, const std::string& to, const std::string& replaced) {
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0) {
    SPES_CHECK(::rename(from.c_str(), replaced.c_str()) == 0, "cannot rename '{}' to '{}': {}",
               from, replaced, std::strerror(errno));
    return true;
  }
  // ENOENT: nothing to replace; EINVAL: no exchange on this file system.
  SPES_CHECK(errno == ENOENT || errno == EINVAL, "cannot rename '{}' to '{}': {}", from, to,
             std::strerror(errno));
  SPES_CHECK(::rename(from.c_str(), to.c_str()) == 0, "cannot rename '{}' to '{}': {}", from, to,
             std::strerror(errno));
  return false;
}

void dir_commit(const std::string& tmp, const std::string& dst) {
  std::error_code ec;
  const std::string old = dst + ".old";
  fs::remove_all(old, ec);
  if (fs::exists(dst)) fs::rename(dst, old);
  fs::rename(tmp, dst);
  dir_fsync(fs::path(dst).parent_path().string());
  fs::remove_all(old, ec);
}

std::string sha256_hex(const void* data, size_t n) {
  unsigned char md[SHA256_DIGEST_LENGTH];
  SHA256(static_cast<const unsigned char*>(data), n, md);
  return hex_encode(md, SHA256_DIGEST_LENGTH);
}

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(ctx_), EVP_sha256(), nullptr);
}
Sha256::~Sha256() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }
void Sha256::update(const void* data, size_t n) {
  EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(ctx_), data, n);
}
std::string Sha256::hex_digest() {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), md, &n);
  return hex_encode(md, n);
}

std::string hex_encode(const unsigned char* bytes, size_t n) {
  static const char* hex = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = hex[bytes[i] >> 4];
    out[2 * i + 1] = hex[bytes[i] & 15];
  }
  return out;
}

bool file_exists(const std::string& path) { return fs::exists(path); }

}  // namespace spes
