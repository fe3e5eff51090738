// File helpers: whole-file read, a file open for reading, exact reads at an offset, JSON lines, atomic write (temporary
// name, fsync, rename), a large file written past the page cache, atomic replacement that
// leaves the replaced file for later removal, directory fsync, and SHA-256 digests.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace spes {

std::string file_read(const std::string& path);
// A file open for reading (O_CLOEXEC), closed when this goes: open() throws naming the file
// and why; try_open() gives one that is not open (fd() < 0) instead.
class ReadFile {
 public:
  static ReadFile open(const std::string& path);
  static ReadFile try_open(const std::string& path);
  ReadFile(ReadFile&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  ReadFile& operator=(ReadFile&&) = delete;
  ReadFile(const ReadFile&) = delete;
  ~ReadFile();
  int fd() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  explicit ReadFile(int fd) : fd_(fd) {}
  int fd_ = -1;
};
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
// Writes a large file at `path` (created or truncated) from `next(buf)`, which appends the next
// piece to `buf` (at most a few MiB; nothing once the file is complete), and fsyncs it. Writes
// with O_DIRECT where the file system takes it: the disk reads each piece straight from this
// process's buffer, so that the file costs no copy into the page cache (copying hundreds of MiB
// into fresh page-cache pages takes seconds on a busy virtual machine; the disk's own write
// takes a fraction of that) and the fsync has nothing left to write. Elsewhere (tmpfs, ...) the
// pieces go through the page cache. With `amend_head`, the file's first min(size, 4096) bytes
// as written are handed to it before the fsync; what it leaves there (same length) is written
// over them: a header field whose value was not known when the writing began. Throws naming
// the file and the fix (disk full?) on error; the caller removes the file.
void file_write_direct(const std::string& path,
                       const std::function<void(std::string* buf)>& next,
                       const std::function<void(std::string* head)>& amend_head = nullptr);
// Renames `from` to `to` atomically. When `to` exists, the two are exchanged (renameat2
// RENAME_EXCHANGE) and the replaced file is then renamed to `replaced`, for the caller to
// remove off its critical path (freeing a large file's blocks takes time, more so on a disk
// mounted with discard); returns whether there was one. Where the exchange is unsupported, a
// plain rename (as atomic; it frees the old file's blocks at once).
bool file_replace(const std::string& from, const std::string& to, const std::string& replaced);
// Replaces directory `dst` with the fully written directory `tmp` atomically (rename; the
// previous `dst` is kept as `dst.old` for the moment between the two renames).
void dir_commit(const std::string& tmp, const std::string& dst);
// Completes a dir_commit cut short between its renames (the process killed): `dst` missing and
// `dst.old` present is renamed back. Returns true when it did.
bool dir_commit_recover(const std::string& dst);
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
