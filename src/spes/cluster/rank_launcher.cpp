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

namespace {

// The c10d store the ranks meet at; it lives here for as long as the ranks run (port 0: any
// free port, no race).
c10::intrusive_ptr<c10d::TCPStore> start_store() {
  c10d::TCPStoreOptions so;
  so.port = 0;
  so.isServer = true;
  so.numWorkers = std::nullopt;
  so.waitWorkers = false;
  so.useLibUV = false;
  return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
}

// Starts rank 0..nproc-1 of this executable with the subcommand's arguments (on gloo each with
// its share of the cores) and the SPES_DIST_* variables, each in its own process group.
std::vector<std::unique_ptr<Subprocess>> start_ranks(const Config& cfg,
                                                     const RankLaunchOptions& opts,
                                                     const std::string& backend,
                                                     const std::string& store_addr) {
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
                  {kDistStoreEnv, store_addr},
                  {kDistBackendEnv, backend}},
        /*own_process_group=*/true));
  }
  return ranks;
}

// The ranks while they run: their output relayed, one stop signal passed on, the exit code.
class RankGroup {
 public:
  RankGroup(std::vector<std::unique_ptr<Subprocess>> ranks, std::string prefix)
      : ranks_(std::move(ranks)), prefix_(std::move(prefix)), done_(ranks_.size(), false) {}

  int wait() {
    while (finished_ < ranks_.size()) {
      forward_stop_signal();
      wait_for_output();
      for (size_t r = 0; r < ranks_.size(); ++r) {
        relay_available(r);
        collect_exit(r);
      }
    }
    for (size_t r = 0; r < ranks_.size(); ++r) relay_rest(r);
    return result_;
  }

 private:
  std::vector<std::unique_ptr<Subprocess>> ranks_;
  std::string prefix_;
  std::vector<bool> done_;
  size_t finished_ = 0;
  int result_ = 0;
  bool forwarded_ = false;  // the stop signal this process received, passed on to the ranks

  void kill_running(int sig) {
    for (size_t o = 0; o < ranks_.size(); ++o)
      if (!done_[o]) ranks_[o]->kill(sig);
  }
  // The ranks have their own process group: a Ctrl-C reaches only this process, which passes
  // one orderly stop to every rank (they agree on the step, checkpoint and exit 128 + sig).
  void forward_stop_signal() {
    const int sig = stop_signal();
    if (sig == 0 || forwarded_) return;
    forwarded_ = true;
    kill_running(sig);
  }
  void wait_for_output() {
    std::vector<pollfd> fds;
    for (const auto& r : ranks_)
      if (r->output_fd() >= 0) fds.push_back({r->output_fd(), POLLIN, 0});
    if (!fds.empty()) ::poll(fds.data(), fds.size(), 200);
    else ::usleep(50 * 1000);
  }
  void relay(size_t r, const std::vector<std::string>& lines) const {
    for (const auto& l : lines)
      std::cout << prefix_ << (r == 0 ? "" : "[rank " + std::to_string(r) + "] ") << l << "\n";
    if (!lines.empty()) std::cout.flush();
  }
  void relay_available(size_t r) {
    std::vector<std::string> lines;
    ranks_[r]->read_lines(&lines);
    relay(r, lines);
  }
  void relay_rest(size_t r) {  // what is left in the pipe
    std::vector<std::string> lines;
    while (ranks_[r]->read_lines(&lines)) {}
    relay(r, lines);
  }
  void collect_exit(size_t r) {
    int code = 0;
    if (done_[r] || !ranks_[r]->poll_exit(&code)) return;
    done_[r] = true;
    ++finished_;
    // After a stop, rank 0's code is the node's (130/143 for its checkpoint and stop): a rank
    // waiting for rank 0 in a collective when rank 0 stopped (rank 0 was still joining the
    // sync server) fails with "connection closed", which must not hide the stop.
    if (code == 0 || !(result_ == 0 || (forwarded_ && r == 0))) return;
    result_ = code;
    if (forwarded_) return;  // a stop: the others end by themselves at the same step
    // A failed rank leaves the others inside a collective that cannot complete.
    std::cerr << prefix_ << "rank " << r << " exited with code " << code
              << "; stopping the other ranks\n";
    kill_running(SIGKILL);
  }
};

}  // namespace

int launch_ranks(const Config& cfg, const RankLaunchOptions& opts) {
  const std::string backend = dist_backend_for(cfg, opts.nproc);
  const auto store = start_store();
  const std::string store_addr = "127.0.0.1:" + std::to_string(store->getPort());
  RankGroup group(start_ranks(cfg, opts, backend, store_addr), opts.output_prefix);
  return group.wait();
}

}  // namespace spes
