// The run directory's advisory lock (see run_lock.h).
#include "spes/io/run_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "spes/common/error.h"
#include "spes/io/files.h"

namespace spes {
namespace fs = std::filesystem;

namespace {
std::string lock_path(const std::string& dir) { return dir + "/.lock"; }

// This process's command line from /proc/self/cmdline (NUL-separated).
std::string own_command_line() {
  std::string s;
  try {
    s = file_read("/proc/self/cmdline");
  } catch (const std::exception&) {
    return "";
  }
  while (!s.empty() && s.back() == '\0') s.pop_back();
  for (char& c : s)
    if (c == '\0') c = ' ';
  return s;
}

// The holder written in an open lock file: "<pid>\n<command line>\n".
LockHolder read_holder(int fd) {
  LockHolder h;
  std::string text(4096, '\0');
  const ssize_t n = ::pread(fd, text.data(), text.size(), 0);
  text.resize(n > 0 ? static_cast<size_t>(n) : 0);
  const size_t nl = text.find('\n');
  try {
    h.pid = std::stol(text.substr(0, nl));
  } catch (const std::exception&) {
    h.pid = 0;
  }
  if (nl != std::string::npos) h.command = text.substr(nl + 1);
  while (!h.command.empty() && h.command.back() == '\n') h.command.pop_back();
  return h;
}
}  // namespace

std::string describe_holder(const std::string& dir, const LockHolder& h) {
  return fmt::format("'{}' is being written by process {} ({})", dir, h.pid,
                     h.command.empty() ? "command line unknown" : h.command);
}

RunDirLock::RunDirLock(const std::string& dir) {
  fs::create_directories(dir);
  const std::string path = lock_path(dir);
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  SPES_CHECK(fd_ >= 0, "cannot open the lock file '{}': {}", path, std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    const LockHolder h = read_holder(fd_);
    ::close(fd_);
    fd_ = -1;
    SPES_CHECK(err == EWOULDBLOCK, "cannot lock '{}': {}", path, std::strerror(err));
    fail("{}; one run directory has one writer at a time: stop that process first (Ctrl-C "
         "there, or kill {}; it writes a checkpoint and exits), or choose another --out",
         describe_holder(dir, h), h.pid);
  }
  const std::string text = std::to_string(::getpid()) + "\n" + own_command_line() + "\n";
  // (Should this fail, the lock still holds; a refusal then names no holder.)
  if (::ftruncate(fd_, 0) == 0) (void)!::pwrite(fd_, text.data(), text.size(), 0);
}

RunDirLock::~RunDirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

std::optional<LockHolder> RunDirLock::holder(const std::string& dir) {
  const int fd = ::open(lock_path(dir).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::optional<LockHolder> h;
  if (::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK) h = read_holder(fd);
  ::close(fd);  // (a shared lock taken here is released with it)
  return h;
}

}  // namespace spes
