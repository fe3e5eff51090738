// Child processes (see subprocess.h).
#include "spes/cluster/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>

#include "spes/common/error.h"

extern char** environ;

namespace spes {

Subprocess::Subprocess(const std::vector<std::string>& argv,
                       const std::vector<std::pair<std::string, std::string>>& env,
                       bool own_process_group) {
  SPES_CHECK(!argv.empty(), "subprocess: empty command line");
  int p[2];
  SPES_CHECK(::pipe2(p, O_CLOEXEC) == 0, "subprocess: pipe failed: {}", std::strerror(errno));
  const pid_t parent = ::getpid();
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // The environment is built before fork: the child may only make async-signal-safe calls.
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    bool replaced = false;
    for (const auto& [k, v] : env) replaced |= kv.rfind(k + "=", 0) == 0;
    if (!replaced) env_strings.push_back(kv);
  }
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  pid_ = ::fork();
  if (pid_ < 0) {
    ::close(p[0]);
    ::close(p[1]);
    fail("subprocess: fork failed: {}", std::strerror(errno));
  }
  if (pid_ == 0) {
    // Child: only async-signal-safe calls until exec.
    if (own_process_group) ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(127);
    ::dup2(p[1], STDOUT_FILENO);
    ::dup2(p[1], STDERR_FILENO);
    ::execve(args[0], args.data(), envp.data());
    const char msg[] = "subprocess: exec failed\n";
    (void)!::write(STDERR_FILENO, msg, sizeof(msg) - 1);
    ::_exit(127);
  }
  ::close(p[1]);
  fd_ = p[0];
  ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) | O_NONBLOCK);
}

Subprocess::~Subprocess() {
  if (pid_ > 0 && !exited_) {
    ::kill(pid_, SIGKILL);
    int st;
    ::waitpid(pid_, &st, 0);
  }
  if (fd_ >= 0) ::close(fd_);
}

bool Subprocess::read_lines(std::vector<std::string>* lines) {
  if (fd_ < 0) return false;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd_, buf, sizeof(buf));
    if (n > 0) {
      partial_.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    const bool eof = n == 0;
    size_t start = 0;
    for (size_t pos; (pos = partial_.find('\n', start)) != std::string::npos; start = pos + 1) {
      std::string line = partial_.substr(start, pos - start);
      if (!line.empty() && line.back() == '\r') line.pop_back();
      lines->push_back(std::move(line));
    }
    partial_.erase(0, start);
    if (eof) {
      if (!partial_.empty()) lines->push_back(std::move(partial_));
      partial_.clear();
      ::close(fd_);
      fd_ = -1;
      return false;
    }
    return true;  // EAGAIN: nothing more for now
  }
}

static int decode_status(int st) {
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
  return 1;
}

bool Subprocess::poll_exit(int* code) {
  if (!exited_) {
    int st = 0;
    const pid_t r = ::waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      exited_ = true;
      code_ = decode_status(st);
    }
  }
  if (exited_ && code) *code = code_;
  return exited_;
}

int Subprocess::wait() {
  if (!exited_) {
    int st = 0;
    while (::waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
    }
    exited_ = true;
    code_ = decode_status(st);
  }
  return code_;
}

void Subprocess::kill(int sig) {
  if (pid_ > 0 && !exited_) ::kill(pid_, sig);
}

}  // namespace spes
