// Child processes for `spes launch` and the end-to-end tests: fork/exec with stdout and stderr
// merged into one pipe read line by line without blocking, a death signal tied to the parent
// (SIGTERM: children stop in order when a launcher dies), optionally a process group of their
// own, non-blocking exit checks and kill. Linux only.
// Leaves out: pseudo-terminals, environment editing beyond adding variables.
#pragma once
#include <sys/types.h>

#include <string>
#include <utility>
#include <vector>

namespace spes {

class Subprocess {
 public:
  // Starts argv (argv[0] is the program path) with `env` added to the environment. With
  // `own_process_group` the child leads a process group of its own, so that a Ctrl-C at the
  // terminal reaches only this process, which forwards one orderly stop (launchers).
  Subprocess(const std::vector<std::string>& argv,
             const std::vector<std::pair<std::string, std::string>>& env = {},
             bool own_process_group = false);
  ~Subprocess();  // kills (SIGKILL) and reaps a child still running
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  pid_t pid() const { return pid_; }
  int output_fd() const { return fd_; }  // for poll(); -1 once the pipe is closed
  // Appends the complete lines available now (non-blocking); at EOF also the partial last
  // line. Returns false once the pipe is closed and drained.
  bool read_lines(std::vector<std::string>* lines);
  // Non-blocking: true once the child has exited; *code = exit status or 128 + signal.
  bool poll_exit(int* code);
  int wait();  // blocking; returns the code as poll_exit
  void kill(int sig);
  bool running() const { return !exited_; }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  std::string partial_;
  bool exited_ = false;
  int code_ = 0;
};

}  // namespace spes
