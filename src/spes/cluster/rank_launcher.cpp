// Starting the ranks of one node (see rank_launcher.h).
#include "spes/cluster/rank_launcher.h"

#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <iostream>
#include <memory>

#include "spes/cluster/subprocess.h"
#include "spes/common/error.h"
#include "spes/common/stop_signal.h"
#include "spes/common/sysinfo.h"
#include "spes/train/device.h"
#include "spes/train/distributed.h"

namespace spes {

bool running_as_rank() { return std::getenv(kDistRankEnv) != nullptr; }

std::string dist_backend_for(const Config& cfg, int64_t nproc) {
  SPES_CHECK(nproc >= 1, "--nproc-per-node must be at least 1, found {}", nproc);
  const int64_t per_rank = cfg.device_train_microbatch_size * nproc;
  SPES_CHECK(cfg.global_train_batch_size % per_rank == 0,
             "global_train_batch_size ({}) must be a multiple of device_train_microbatch_size "
             "({}) x --nproc-per-node ({}): every rank runs whole micro-batches",
             cfg.global_train_batch_size, cfg.device_train_microbatch_size, nproc);
  const torch::Device dev = select_device(cfg);
  if (!dev.is_cuda()) return "gloo";
  const int64_t gpus = cuda_device_count();
  SPES_CHECK(gpus >= nproc, "--nproc-per-node {} needs {} GPUs (one per rank) but {} {} visible",
             nproc, nproc, gpus, gpus == 1 ? "is" : "are");
  return "nccl";
}

int launch_ranks(const Config& cfg, const RankLaunchOptions& opts) {
  const std::string backend = dist_backend_for(cfg, opts.nproc);
  // The store lives here, for as long as the ranks run (port 0: any free port, no race).
  c10d::TCPStoreOptions so;
  so.port = 0;
  so.isServer = true;
  so.numWorkers = std::nullopt;
  so.waitWorkers = false;
  so.useLibUV = false;
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  const std::string addr = "127.0.0.1:" + std::to_string(store->getPort());
  const std::string exe = opts.executable.empty() ? "/proc/self/exe" : opts.executable;
  std::vector<std::string> args = opts.args;
  if (backend == "gloo") {  // the cores are shared between the ranks
    const int64_t cores = cfg.threads > 0 ? cfg.threads : cpu_cores();
    args.push_back("--set");
    args.push_back("threads=" + std::to_string(std::max<int64_t>(1, cores / opts.nproc)));
  }
  std::vector<std::unique_ptr<Subprocess>> ranks;
  for (int64_t r = 0; r < opts.nproc; ++r) {
    std::vector<std::string> argv = {exe};
    argv.insert(argv.end(), args.begin(), args.end());
    ranks.push_back(std::make_unique<Subprocess>(
        argv, std::vector<std::pair<std::string, std::string>>{
                  {kDistRankEnv, std::to_string(r)},
                  {kDistSizeEnv, std::to_string(opts.nproc)},
                  {kDistStoreEnv, addr},
                  {kDistBackendEnv, backend}},
        /*own_process_group=*/true));
  }
  auto relay = [&](size_t r, const std::vector<std::string>& lines) {
    for (const auto& l : lines)
      std::cout << opts.output_prefix << (r == 0 ? "" : "[rank " + std::to_string(r) + "] ") << l
                << "\n";
    if (!lines.empty()) std::cout.flush();
  };
  int result = 0;
  std::vector<bool> done(ranks.size(), false);
  size_t finished = 0;
  bool forwarded = false;  // the stop signal this process received, passed on to the ranks
  while (finished < ranks.size()) {
    // The ranks have their own process group: a Ctrl-C reaches only this process, which passes
    // one orderly stop to every rank (they agree on the step, checkpoint and exit 128 + sig).
    if (const int sig = stop_signal(); sig != 0 && !forwarded) {
      forwarded = true;
      for (size_t o = 0; o < ranks.size(); ++o)
        if (!done[o]) ranks[o]->kill(sig);
    }
    std::vector<pollfd> fds;
    for (const auto& r : ranks)
      if (r->output_fd() >= 0) fds.push_back({r->output_fd(), POLLIN, 0});
    if (!fds.empty()) ::poll(fds.data(), fds.size(), 200);
    else ::usleep(50 * 1000);
    for (size_t r = 0; r < ranks.size(); ++r) {
      std::vector<std::string> lines;
      ranks[r]->read_lines(&lines);
      relay(r, lines);
      int code = 0;
      if (done[r] || !ranks[r]->poll_exit(&code)) continue;
      done[r] = true;
      ++finished;
      // After a stop, rank 0's code is the node's (130/143 for its checkpoint and stop): a
      // rank waiting for rank 0 in a collective when rank 0 stopped (rank 0 was still joining
      // the sync server) fails with "connection closed", which must not hide the stop.
      if (code != 0 && (result == 0 || (forwarded && r == 0))) {
        result = code;
        if (forwarded) continue;  // a stop: the others end by themselves at the same step
        // A failed rank leaves the others inside a collective that cannot complete.
        std::cerr << opts.output_prefix << "rank " << r << " exited with code " << code
                  << "; stopping the other ranks\n";
        for (size_t o = 0; o < ranks.size(); ++o)
          if (!done[o]) ranks[o]->kill(SIGKILL);
      }
    }
  }
  for (size_t r = 0; r < ranks.size(); ++r) {  // what is left in the pipes
    std::vector<std::string> lines;
    while (ranks[r]->read_lines(&lines)) {}
    relay(r, lines);
  }
  return result;
}

}  // namespace spes
