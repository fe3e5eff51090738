// Starting the N processes of one node (`--nproc-per-node N` on `spes train` and `spes node`):
// this process hosts the c10d TCPStore and starts this executable N times with the same
// arguments plus the SPES_DIST_* variables (distributed.h) and, on CPU, an equal share of the
// threads each. Rank 0's output passes through unchanged, other ranks' lines get "[rank r] ".
// The ranks run in a process group of their own: SIGINT/SIGTERM to this process is passed
// on to every rank once (an orderly stop at the same step, common/stop_signal.h). When a rank
// fails the others are killed (they wait in a collective that cannot complete); the exit
// code is the first failure's (0 when all succeeded; after a stop, rank 0's). Leaves out: restarting failed ranks, ranks on other machines.
#pragma once
#include <string>
#include <vector>

#include "spes/io/config.h"

namespace spes {

struct RankLaunchOptions {
  int64_t nproc = 1;
  std::vector<std::string> args;  // the subcommand's arguments (without the executable)
  std::string executable;         // default: this executable
  std::string output_prefix;      // before every relayed line (e.g. "[node 1] ")
};

// Checks that `cfg` can run as nproc ranks (the global batch splits into whole micro-batches
// per rank; on CUDA one GPU per rank) and returns the backend: nccl on CUDA, gloo on CPU.
std::string dist_backend_for(const Config& cfg, int64_t nproc);
// Runs the ranks to completion; returns the exit code.
int launch_ranks(const Config& cfg, const RankLaunchOptions& opts);
// True in a process started by launch_ranks (SPES_DIST_RANK is set).
bool running_as_rank();

}  // namespace spes
