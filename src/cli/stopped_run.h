// How `spes train` and `spes node` end after an orderly stop (SIGINT/SIGTERM,
// common/stop_signal.h): the trainer has written OUT/checkpoint; this prints the command that
// continues the run and ends with exit code 128 + signal (130 for Ctrl-C, 143 for SIGTERM).
#pragma once
#include "spes/train/trainer.h"

namespace spes::cli {

// When `t.stopped_by()` is set: prints how to continue (rank 0 only) and exits; else returns.
void end_if_stopped(const Trainer& t);
// The command line of this process as the user would type it to continue the run: `spes`
// and its arguments, shell-quoted, without `--resume none` (resuming is the default) and
// `--overwrite` (it would delete what the run wrote).
std::string continue_command();

}  // namespace spes::cli
