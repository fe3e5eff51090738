// The orderly stop on SIGINT/SIGTERM (see stop_signal.h).
#include "spes/common/stop_signal.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>

namespace spes {

namespace {
std::atomic<int> g_stop{0};

void on_stop_signal(int sig) {
  // The second signal: end now (async-signal-safe), with the code of an ordinary stop.
  if (g_stop.exchange(sig) != 0) ::_exit(stop_exit_code(sig));
}
}  // namespace

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

int stop_signal() { return g_stop.load(); }

void request_stop(int sig) { g_stop.store(sig); }

std::string signal_name(int sig) {
  if (sig == SIGINT) return "SIGINT";
  if (sig == SIGTERM) return "SIGTERM";
  return "signal " + std::to_string(sig);
}

}  // namespace spes
