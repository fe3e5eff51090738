// One writer per run directory: an advisory lock (flock) on DIR/.lock, held for as long as the
// process that writes DIR lives (spes train, node, serve and launch take it for their --out;
// launch for DIR, its server and nodes each for their own subdirectory, so a launch with
// --resume is never blocked by its own children). The file names the holder's PID and command
// line, so a second writer is refused with both. The kernel drops the lock when its holder
// ends, however it ends; the descriptor is close-on-exec (children do not inherit it).
#pragma once
#include <optional>
#include <string>

namespace spes {

struct LockHolder {
  long pid = 0;
  std::string command;  // its command line, arguments separated by spaces
};

class RunDirLock {
 public:
  // Creates DIR if needed and takes its lock; refuses (spes::Error) when another process holds
  // it, naming that process and the fix.
  explicit RunDirLock(const std::string& dir);
  ~RunDirLock();
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;

  // The process holding DIR's lock now, if any (DIR need not exist).
  static std::optional<LockHolder> holder(const std::string& dir);

 private:
  int fd_ = -1;
};

// "'DIR' is being written by process PID (COMMAND)": the start of every refusal.
std::string describe_holder(const std::string& dir, const LockHolder& h);

}  // namespace spes
