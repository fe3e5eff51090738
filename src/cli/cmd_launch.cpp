// `spes launch`: a local SPES cluster (the sync server and N nodes as separate processes on
// localhost) with one combined progress view, the cluster summary, and the final model's
// validation loss next to the unigram baseline with a generated sample.
#include <cstdlib>

#include "cli/common_options.h"
#include "cli/command.h"
#include "cli/run_summary.h"
#include "spes/cluster/launch.h"

namespace {

spes::cli::SubcommandRegistrar register_launch("launch", "Run a sync server and N SPES nodes on localhost",
                                   [](CLI::App& sub) {
  auto a = std::make_shared<spes::LaunchOptions>();
  auto no_summary = std::make_shared<bool>(false);
  sub.add_option("--config", a->config, "YAML config (default: the built-in configs/default.yaml)");
  sub.add_option("--nodes", a->nodes, "Number of nodes (0: spes_config.num_peers, or 4)");
  sub.add_option("--out", a->out, "Run directory (server/, node<i>/, summary.json)");
  spes::cli::add_set_option(sub, a->sets, "the server and every node");
  sub.add_flag("--keep-uploads", a->keep_uploads,
               "Keep every upload and published model; the summary re-checks each round");
  sub.add_flag("--overwrite", a->overwrite, "Replace an earlier run in --out");
  sub.add_option("--nproc-per-node", a->nproc_per_node,
                 "Processes per node (data parallel: one per GPU, or sharing the cores)");
  sub.add_option("--stop-timeout", a->stop_timeout_s,
                 "Seconds the nodes and the server get to write their checkpoints after Ctrl-C "
                 "or SIGTERM (or a failed part) before they are killed")
      ->check(CLI::PositiveNumber);
  sub.add_flag("--no-summary", *no_summary,
               "Skip the final model's baseline comparison and sample");
  sub.callback([a, no_summary] {
    const int code = spes::launch_cluster(*a);
    if (code != 0) std::exit(code);
    if (!*no_summary) spes::cli::print_cluster_summary(a->out);
  });
});

}  // namespace
