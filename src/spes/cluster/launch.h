// A local SPES cluster: `spes serve` and N `spes node` processes on localhost (fork/exec of
// this executable, the server on a free loopback port; its status page's URL is printed as
// "dashboard: http://..." once the server is up), one progress view (launch_view.h: a line per
// part redrawn in place on a terminal, a plain line every few seconds otherwise; every line of
// a part in DIR/<part>/log.txt), failure handling (any part failing stops the rest, its last
// lines are printed; the exit code says so) and the end-of-run summary
// (run_report.h). The parts run in process groups of their own: SIGINT/SIGTERM to the launcher
// is passed on once, to the nodes first (each writes its checkpoint) and then the server,
// which get stop_timeout_s to exit; the launcher then exits with 128 + signal (130: Ctrl-C).
// A run directory has one writer (io/run_lock.h): the launcher locks DIR, the server and each
// node their own subdirectory. On a DIR holding an earlier run it asks for --resume (continue:
// the server from its state, each node from its checkpoint) or --overwrite (start over, refused
// while a part of that run still runs) and changes nothing. A scripted disruption
// (launch_disruption.h: --kill-node / --depart-node I --at-round R) stops one node mid-run on
// purpose; an arrival (--add-node-at-round R) starts one more node, id N, with `spes node
// --join-new` once round R is published (spes_config.max_nodes is then N + 1). Leaves out:
// remote machines, restarting failed parts.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "spes/cluster/launch_disruption.h"
#include "spes/cluster/launch_view.h"

namespace spes {

struct LaunchOptions {
  std::string config;                // YAML config (empty: built-in defaults)
  std::vector<std::string> sets;     // --set overrides, applied to every part
  int64_t nodes = 0;                 // 0: spes_config.num_peers if > 1, else 4
  std::string out = "runs/launch";
  bool keep_uploads = false;         // server keeps every upload; the summary then re-checks
                                     // every round offline (`spes aggregate`'s code)
  bool overwrite = false;            // replace DIR/server and DIR/node* of an earlier run
  bool resume = false;               // continue the run in DIR (server and nodes from their
                                     // directories; the config of DIR/config.yaml)
  std::string executable;            // default: this executable
  int64_t nproc_per_node = 1;        // processes per node (`spes node --nproc-per-node`)
  LaunchViewMode progress = LaunchViewMode::Auto;  // launch_view.h: live on a terminal, else
                                                   // plain
  double progress_every_s = 10;      // plain view: one line this often
  double stop_timeout_s = 600;       // after a stop (or a failure), how long the parts get to
                                     // write their checkpoints before they are killed
  NodeDisruption disruption;         // one node killed or departing after a round, on purpose
  int64_t add_node_after_round = 0;  // > 0: one more node joins after this round
};

// Runs the cluster to completion and prints the summary; returns the process exit code
// (0 only when every part succeeded and every check passed).
int launch_cluster(const LaunchOptions& opts);

}  // namespace spes
