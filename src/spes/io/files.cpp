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

// The file file_write_direct writes: opened with O_DIRECT where the file system allows it.
// O_DIRECT takes whole blocks from an aligned buffer at aligned offsets: the pieces are
// gathered in `block_` and written a whole number of blocks at a time; the tail is padded
// with zeros and the file cut back to its size at the end. Closed on every way out (the
// caller's callbacks may throw).
class DirectFile {
 public:
  DirectFile(const std::string& path, const detail::WriteCall& write_call)
      : path_(path), write_call_(write_call) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0644);
    direct_ = fd_ >= 0;
    if (!direct_) fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    SPES_CHECK(fd_ >= 0, "cannot create '{}': {}", path, std::strerror(errno));
  }
  ~DirectFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  DirectFile(const DirectFile&) = delete;
  DirectFile& operator=(const DirectFile&) = delete;

  // Appends the piece: gathered into blocks (direct), or written as it is.
  void append(const std::string& piece) {
    total_ += piece.size();
    if (!direct_) {
      if (!write_all(write_call_, fd_, piece.data(), piece.size())) failed("write");
      return;
    }
    reserve(held_ + piece.size());
    std::memcpy(block_.get() + held_, piece.data(), piece.size());
    held_ += piece.size();
    if (!flush_blocks(false)) fall_back();
  }

  // Writes what is still gathered (direct: padded to a whole block).
  void flush_tail() {
    if (direct_ && !flush_blocks(true)) fall_back();
  }

  // Writes `head` again at offset 0 (direct: as one aligned block; past the end of a file
  // shorter than a block, the padding is cut off by commit()).
  void rewrite_head(const std::string& head) {
    const char* src = head.data();
    size_t len = head.size();
    if (direct_) {
      std::memcpy(block_.get(), head.data(), head.size());
      std::memset(block_.get() + head.size(), 0, kDirectAlign - head.size());
      src = block_.get();
      len = kDirectAlign;
    }
    for (size_t done = 0; done < len;) {
      const ssize_t w = ::pwrite(fd_, src + done, len - done, static_cast<off_t>(done));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) failed("write");
      done += static_cast<size_t>(w);
    }
  }

  // Cuts the file to the bytes appended, syncs and closes it.
  void commit() {
    if (::ftruncate(fd_, static_cast<off_t>(total_)) != 0) failed("write");
    if (::fsync(fd_) != 0) failed("sync");
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail("cannot write '{}': {} (disk full?)", path_, std::strerror(errno));
  }

 private:
  [[noreturn]] void failed(const char* what) const {
    const int e = errno;
    fail("cannot {} '{}': {} (disk full? free space there and retry)", what, path_,
         std::strerror(e));
  }

  // Room in `block_` for `bytes` and a block more, keeping what it holds.
  void reserve(size_t bytes) {
    if (bytes + kDirectAlign <= capacity_) return;
    capacity_ = (bytes + 2 * kDirectAlign) / kDirectAlign * kDirectAlign;
    std::unique_ptr<char, decltype(&std::free)> bigger(
        static_cast<char*>(std::aligned_alloc(kDirectAlign, capacity_)), &std::free);
    SPES_CHECK(bigger, "out of memory writing '{}'", path_);
    if (held_) std::memcpy(bigger.get(), block_.get(), held_);
    block_ = std::move(bigger);
  }

  // Writes the whole blocks of `block_` (all of it, padded, when `last`), keeping the rest;
  // false (errno set, nothing kept changed) when the write fails.
  bool flush_blocks(bool last) {
    const size_t whole = last ? (held_ + kDirectAlign - 1) / kDirectAlign * kDirectAlign
                              : held_ / kDirectAlign * kDirectAlign;
    if (whole == 0) return true;
    std::memset(block_.get() + held_, 0, whole - std::min(whole, held_));
    if (!write_all(write_call_, fd_, block_.get(), whole)) return false;
    held_ -= std::min(whole, held_);
    std::memmove(block_.get(), block_.get() + whole, held_);
    return true;
  }

  // After a failed direct write: EINVAL before anything was written means this file system
  // wants another alignment; go on through the page cache from the start (`block_` holds
  // everything so far). Any other failure is an error.
  void fall_back() {
    if (errno != EINVAL || held_ != total_) failed("write");
    direct_ = false;
    if (::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) & ~O_DIRECT) != 0 ||
        ::lseek(fd_, 0, SEEK_SET) != 0 || !write_all(write_call_, fd_, block_.get(), held_))
      failed("write");
    held_ = 0;
  }

  std::string path_;
  const detail::WriteCall& write_call_;
  int fd_ = -1;
  bool direct_ = false;
  std::unique_ptr<char, decltype(&std::free)> block_{nullptr, &std::free};
  size_t capacity_ = 0, held_ = 0;
  uint64_t total_ = 0;  // bytes appended
};
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
  DirectFile file(path, write_call);
  std::string piece, head;  // head: the file's first bytes (up to a block), for amend_head
  for (;;) {
    piece.clear();
    next(&piece);
    if (piece.empty()) break;
    if (amend_head && head.size() < kDirectAlign)
      head.append(piece, 0, std::min(piece.size(), kDirectAlign - head.size()));
    file.append(piece);
  }
  file.flush_tail();
  if (amend_head && !head.empty()) {
    const size_t n = head.size();
    amend_head(&head);
    SPES_CHECK(head.size() == n, "'{}': the amended head changed length ({} -> {} bytes)", path,
               n, head.size());
    file.rewrite_head(head);
  }
  file.commit();
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

bool dir_commit_recover(const std::string& dst) {
  const std::string old = dst + ".old";
  if (fs::exists(dst) || !fs::is_directory(old)) return false;
  fs::rename(old, dst);
  dir_fsync(fs::path(dst).parent_path().string());
  return true;
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
