// `spes launch`: a local SPES cluster (the sync server and N nodes as separate processes on
// localhost) with one combined progress view, the cluster summary, and the final model's
// validation loss next to the unigram baseline with a generated sample.
#include <cstdio>
#include <cstdlib>

#include "cli/common_options.h"
#include "cli/command.h"
#include "cli/run_summary.h"
#include "cli/stopped_run.h"
#include "spes/cluster/launch.h"
#include "spes/common/stop_signal.h"

namespace {

spes::cli::SubcommandRegistrar register_launch("launch", "Run a sync server and N SPES nodes on localhost",
                                   [](CLI::App& sub) {
  auto a = std::make_shared<spes::LaunchOptions>();
  auto no_summary = std::make_shared<bool>(false);
  auto progress = std::make_shared<std::string>("auto");
  sub.add_option("--config", a->config, "YAML config (default: the built-in configs/default.yaml)");
  sub.add_option("--nodes", a->nodes, "Number of nodes (0: spes_config.num_peers, or 4)")
      ->check(CLI::Range(int64_t{0}, int64_t{1024}));
  sub.add_option("--out", a->out, "Run directory (server/, node<i>/, summary.json)");
  spes::cli::add_set_option(sub, a->sets, "the server and every node");
  sub.add_flag("--keep-uploads", a->keep_uploads,
               "Keep every upload and published model; the summary re-checks each round");
  sub.add_flag("--overwrite", a->overwrite, "Delete an earlier run in --out and start over "
               "(refused while it runs)");
  sub.add_flag("--resume", a->resume, "Continue the run in --out: the server from its state, "
               "every node from its checkpoint (the config: --out/config.yaml, unless given "
               "again the same)");
  sub.add_option("--nproc-per-node", a->nproc_per_node,
                 "Processes per node (data parallel: one per GPU, or sharing the cores)")
      ->check(CLI::Range(int64_t{1}, int64_t{1024}));
  sub.add_option("--stop-timeout", a->stop_timeout_s,
                 "Seconds the nodes and the server get to write their checkpoints after Ctrl-C "
                 "or SIGTERM (or a failed part) before they are killed")
      ->check(CLI::PositiveNumber);
  sub.add_option("--progress", *progress,
                 "auto (live on a terminal, else plain), live (a line per part redrawn in "
                 "place), plain (a line every --progress-every seconds), all (every line of "
                 "every part); each part's lines are in --out/<part>/log.txt")
      ->check(CLI::IsMember({"auto", "live", "plain", "all"}));
  sub.add_option("--progress-every", a->progress_every_s,
                 "Seconds between the lines of the plain view (default 10)")
      ->check(CLI::PositiveNumber);
  auto kill_node = std::make_shared<int64_t>(-1), depart_node = std::make_shared<int64_t>(-1);
  auto at_round = std::make_shared<int64_t>(0);
  auto* kill = sub.add_option("--kill-node", *kill_node,
                              "Kill node I with SIGKILL once the server published --at-round R "
                              "(a machine that vanished; the rest runs on)");
  auto* depart = sub.add_option("--depart-node", *depart_node,
                                "Stop node I (started with --depart) with SIGTERM once the "
                                "server published --at-round R: it leaves the run for good");
  auto* at = sub.add_option("--at-round", *at_round,
                            "The round after which --kill-node / --depart-node acts");
  kill->excludes(depart)->needs(at);
  depart->needs(at);
  sub.add_option("--add-node-at-round", a->add_node_after_round,
                 "Start one more node (the next id, `spes node --join-new`; "
                 "spes_config.max_nodes becomes --nodes + 1) once the server published round R: "
                 "it takes experts from the most loaded nodes at the next round boundary")
      ->check(CLI::PositiveNumber);
  sub.add_flag("--no-summary", *no_summary,
               "Skip the final model's baseline comparison and sample");
  sub.callback([a, no_summary, progress, kill_node, depart_node, at_round, at] {
    a->progress = spes::launch_view_mode_from_string(*progress);
    if (*kill_node >= 0 || *depart_node >= 0) {
      a->disruption.kind = *kill_node >= 0 ? spes::NodeDisruption::Kind::Kill
                                           : spes::NodeDisruption::Kind::Depart;
      a->disruption.node = *kill_node >= 0 ? *kill_node : *depart_node;
      a->disruption.at_round = *at_round;
    } else if (at->count() > 0) {
      throw CLI::ValidationError("--at-round", "needs --kill-node or --depart-node");
    }
    const int code = spes::launch_cluster(*a);
    if (spes::stop_signal() != 0 && code == spes::stop_exit_code(spes::stop_signal())) {
      std::string cmd = spes::cli::continue_command();
      if (!a->resume) cmd += " --resume";
      std::fprintf(stderr, "to continue the run in %s:\n  %s\n", a->out.c_str(), cmd.c_str());
    }
    if (code != 0) std::exit(code);
    if (!*no_summary) spes::cli::print_cluster_summary(a->out);
  });
});

}  // namespace
