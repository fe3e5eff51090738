// An orderly stop on SIGINT or SIGTERM, the way torchrun and Hugging Face trainers users expect:
// the first signal only sets a flag that long-running commands read at safe points (a
// trainer's step boundary, a node waiting for a round, a launcher's loop); they finish the step,
// write their checkpoint (atomically, as every checkpoint) and exit with 128 + signal (130 for
// Ctrl-C, 143 for SIGTERM). A second signal ends the process at once with the same code; since
// every file a run keeps is written into a temporary name and renamed, only complete files
// remain (a partial checkpoint.tmp.PID is removed by the next run in that directory).
// The commands then end with cli::exit_with(stop_exit_code(sig)).
#pragma once
#include <string>

namespace spes {

// Installs the handlers for SIGINT and SIGTERM (idempotent; the last signal's number is kept).
void install_stop_handlers();
// 0 while no stop was requested, else the signal that requested it.
int stop_signal();
// Requests a stop as if `sig` had arrived (tests, and a launcher forwarding one).
void request_stop(int sig);
// The exit code of a process stopped by `sig`: 128 + sig.
inline int stop_exit_code(int sig) { return 128 + sig; }
// "SIGINT", "SIGTERM", or "signal N".
std::string signal_name(int sig);

}  // namespace spes
