// `spes node`: one SPES node: trains the shared tensors plus its own experts (mode spes) or
// everything (fedavg, diloco), syncing with `spes serve` every spes_config.sync_steps steps.
// Writes OUT/metrics.jsonl (sync records included) and OUT/checkpoint like `spes train`
// (every save_interval steps too); restarted with the same OUT it resumes from its checkpoint.
// The node's token comes from --token-file or SPES_NODE_TOKEN. With --nproc-per-node N the node
// is N data-parallel processes (one per GPU, or sharing the cores); rank 0 talks to the server
// and hands what it receives to the others (train/rank0_observer.h).
#include <spdlog/spdlog.h>

#include <optional>

#include "cli/common_options.h"
#include "cli/command.h"
#include "cli/node_ranks.h"
#include "cli/node_round_hooks.h"
#include "cli/stopped_run.h"
#include "cli/tls_dir.h"
#include "spes/cluster/rank_launcher.h"
#include "spes/common/stop_signal.h"
#include "spes/interop/init_checkpoint.h"
#include "spes/io/config.h"
#include "spes/io/run_lock.h"
#include "spes/sync/node/node.h"
#include "spes/sync/wire/auth.h"
#include "spes/train/rank0_observer.h"
#include "spes/train/trainer.h"

namespace {

struct NodeArgs {
  std::string config, out, server, resume = "auto", progress = "auto", token_file;
  int64_t node_id = -1;
  double connect_timeout = 120;
  std::vector<std::string> sets;
  int64_t nproc = 1;
  bool insecure = false, depart = false, join_new = false;
  std::string tls_dir;
};

void run_node(const NodeArgs& a) {
  spes::Config cfg = spes::config_load(a.config, a.sets);
  const int64_t id = a.node_id >= 0 ? a.node_id : cfg.spes_config.peer_id;
  const int64_t slots = cfg.spes_config.node_slots();
  SPES_CHECK(id < slots, "--node-id {} is outside [0, {}) (spes_config.num_peers={}, max_nodes={}: "
             "the node ids this run admits; raise spes_config.max_nodes, on the server too, to "
             "admit more)", id, slots, cfg.spes_config.num_peers, cfg.spes_config.elastic.max_nodes);
  SPES_CHECK(id < cfg.spes_config.num_peers || a.join_new, "--node-id {} is not one of the "
             "initial nodes [0, num_peers={}): a node that arrives mid-run is started with "
             "--join-new", id, cfg.spes_config.num_peers);
  if (!a.tls_dir.empty()) spes::cli::node_tls_from_dir(cfg.spes_config.transport, a.tls_dir, id);
  const std::string out = a.out.empty() ? "runs/node" + std::to_string(id) : a.out;
  // One writer per run directory (the ranks of --nproc-per-node write under their parent's).
  std::optional<spes::RunDirLock> lock;
  if (!spes::running_as_rank()) lock.emplace(out);
  spes::install_stop_handlers();  // Ctrl-C / SIGTERM: checkpoint at the next step, then exit
  if (spes::cli::run_node_ranks(cfg, a.nproc)) return;  // started the ranks, which are done
  std::unique_ptr<spes::DistGroup> dist = spes::DistGroup::from_environment();
  std::unique_ptr<spes::sync::SyncNode> node;  // rank 0 (or the only process) talks to the server
  if (!dist || dist->rank() == 0) {
    spes::sync::NodeOptions no;
    no.server = a.server.empty() ? cfg.spes_config.transport.server_addr : a.server;
    no.connect_timeout_s = a.connect_timeout;
    no.auth_token = spes::sync::node_token(a.token_file);
    no.insecure = a.insecure;
    no.depart = a.depart;
    no.hooks = spes::cli::node_round_hooks(id);
    node = std::make_unique<spes::sync::SyncNode>(no);
  }
  std::unique_ptr<spes::Rank0Observer> ranks;
  spes::TrainerOptions opts;
  opts.node_id = id;
  opts.resume_from = a.resume == "none" ? "" : a.resume;
  opts.progress = spes::progress_mode_from_string(a.progress);
  opts.observer = node.get();
  opts.dist = dist.get();
  if (dist) {
    ranks = std::make_unique<spes::Rank0Observer>(*dist, node.get());
    opts.observer = ranks.get();
  }
  // From the same initial weights as the server's, a fresh node holds its published model
  // already and joins without downloading it.
  spes::Trainer trainer(cfg, out, opts, spes::init_checkpoint_weights(cfg.model));
  if (!trainer.is_rank0()) {
    trainer.run();
    spes::cli::end_if_stopped(trainer);
    return;
  }
  spdlog::info("node {}: {:.2f}M parameters, {:.2f}M trainable here ({} mode), {} steps, out {}",
               id, trainer.model().num_params() / 1e6, trainer.registry().trainable_numel() / 1e6,
               cfg.spes_config.mode, cfg.total_steps(), out);
  spes::EvalResult r;
  try {
    r = trainer.run();
  } catch (const spes::sync::NodeStopped& e) {  // before the first step: nothing to save
    spdlog::warn("{}; to continue run:\n  {}", e.what(), spes::cli::continue_command());
    spes::cli::exit_with(spes::stop_exit_code(spes::stop_signal()));
  }
  spes::cli::end_if_stopped(trainer);
  spdlog::info("node {}: done; final validation loss {:.4f} (perplexity {:.2f})", id, r.loss,
               r.perplexity);
}

spes::cli::SubcommandRegistrar register_node("node", "Run one SPES node against a sync server",
                                   [](CLI::App& sub) {
  auto a = std::make_shared<NodeArgs>();
  sub.add_option("--config", a->config, "YAML config (the same as the server's)");
  sub.add_option("--node-id", a->node_id, "This node's id in [0, num_peers), or in "
                 "[num_peers, max_nodes) with --join-new (default: spes_config.peer_id)")
      ->check(CLI::NonNegativeNumber);
  sub.add_option("--server", a->server, "host:port of `spes serve` "
                 "(default: spes_config.server_addr)");
  sub.add_option("--out", a->out, "Run directory (default: runs/node<I>)");
  spes::cli::add_set_option(sub, a->sets);
  spes::cli::add_training_options(sub, a->resume, a->progress, a->nproc,
                                  "rank 0 syncs with the server");
  sub.add_option("--connect-timeout", a->connect_timeout,
                 "Seconds to keep retrying while the server is not up")
      ->check(CLI::PositiveNumber);
  sub.add_option("--token-file", a->token_file, "File holding this node's secret token "
                 "(default: $SPES_NODE_TOKEN; see spes_config.auth_tokens_file); must not be "
                 "readable by group or others (chmod 600)");
  sub.add_option("--tls-dir", a->tls_dir, "Mutual TLS with the files `spes certs` made: "
                 "DIR/ca.pem verifies the server, DIR/node<I>.pem and node<I>.key are this "
                 "node's certificate (copy only those three to the node's machine)");
  sub.add_flag("--insecure", a->insecure, "Allow a plaintext connection to a server that is not "
               "on loopback (the token and the model cross the network unprotected; default: "
               "refused without spes_config.tls_ca)");
  sub.add_flag("--depart", a->depart, "Leave the run for good when stopped (SIGINT/SIGTERM): "
               "the node hands the AdamW moments of its experts to the server, which gives them "
               "with the experts to live nodes at the next round (spes_config."
               "reassign_after_rounds > 0), so training them goes on where it stopped; without "
               "it a stopped node is expected back");
  sub.add_flag("--join-new", a->join_new, "This node arrives in a running run (issue 38): its "
               "--node-id may be one of [num_peers, spes_config.max_nodes), or a departed id "
               "coming back; it takes the published model, trains the shared tensors, and from "
               "the next round boundary the experts the server takes for it from the most loaded "
               "nodes (with their AdamW moments). Restarted with the same --out it resumes from "
               "its checkpoint like any node");
  sub.callback([a] { run_node(*a); });
});

}  // namespace
