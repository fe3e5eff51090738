// The end of a stopped run (see stopped_run.h).
#include "cli/stopped_run.h"

#include <fmt/format.h>

#include <cstdio>

#include "cli/command.h"
#include "spes/common/stop_signal.h"

namespace spes::cli {

namespace {
std::string shell_quote(const std::string& a) {
  if (!a.empty() && a.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                        "0123456789-_./=:,+@%") == std::string::npos)
    return a;
  std::string q = "'";
  for (char c : a) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}
}  // namespace

std::string continue_command() {
  const std::vector<std::string>& args = command_line_args();
  std::string cmd = "spes";
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--resume" && i + 1 < args.size() && args[i + 1] == "none") {
      ++i;
      continue;
    }
    if (args[i] == "--resume=none" || args[i] == "--overwrite") continue;
    cmd += " " + shell_quote(args[i]);
  }
  return cmd;
}

void end_if_stopped(const Trainer& t) {
  const int sig = t.stopped_by();
  if (sig == 0) return;
  if (t.is_rank0()) {
    fmt::print(stderr, "stopped by {} at step {}; to continue from {}/checkpoint run:\n  {}\n",
               signal_name(sig), t.state().step, t.out_dir(),
               continue_command());
    std::fflush(stderr);
  }
  exit_with(stop_exit_code(sig));
}

}  // namespace spes::cli
