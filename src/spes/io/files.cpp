// File helpers (see files.h).
#include "spes/io/files.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <openssl/sha.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
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
