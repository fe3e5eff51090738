// File helpers: whole-file read, exact reads at an offset, JSON lines, atomic write (temporary
// name, fsync, rename), directory fsync, and SHA-256 digests.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace spes {

std::string file_read(const std::string& path);
// Reads exactly n bytes of the open file `fd` at `offset` into dst (pread, retried after a
// short read or EINTR); throws naming `what` when the file ends first or a read fails.
void file_pread_exact(int fd, void* dst, uint64_t n, uint64_t offset, const std::string& what);
// The records of a JSONL file (missing file: none). A line that does not parse (one being
// written when the run stopped) is skipped.
std::vector<nlohmann::json> read_jsonl(const std::string& path);
// Writes `data` to path atomically: path.tmp.<pid>, fsync, rename, fsync of the directory.
void file_write_atomic(const std::string& path, const std::string& data);
// fsyncs a directory so that a rename inside it is durable.
void dir_fsync(const std::string& dir);
// Replaces directory `dst` with the fully written directory `tmp` atomically (rename).
void dir_commit(const std::string& tmp, const std::string& dst);
std::string sha256_hex(const void* data, size_t n);
inline std::string sha256_hex(const std::string& s) { return sha256_hex(s.data(), s.size()); }
// Incremental SHA-256 (OpenSSL EVP).
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* data, size_t n);
  std::string hex_digest();  // finishes the digest

 private:
  void* ctx_;
};
// Lower-case hex of n bytes.
std::string hex_encode(const unsigned char* bytes, size_t n);
bool file_exists(const std::string& path);

}  // namespace spes
