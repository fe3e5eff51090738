// `spes train`: trains one node (centralized by default) from a YAML config, writing
// OUT/metrics.jsonl and OUT/checkpoint, and ends with a summary (validation loss vs the
// unigram baseline of the same data, and a generated sample).
#include <spdlog/spdlog.h>

#include <optional>

#include "cli/common_options.h"
#include "cli/command.h"
#include "cli/node_ranks.h"
#include "cli/run_summary.h"
#include "cli/stopped_run.h"
#include "spes/cluster/rank_launcher.h"
#include "spes/common/stop_signal.h"
#include "spes/interop/init_checkpoint.h"
#include "spes/io/config.h"
#include "spes/io/run_lock.h"
#include "spes/model/model_size_guard.h"
#include "spes/train/device.h"
#include "spes/train/trainer.h"

namespace {

struct TrainArgs {
  std::string config, out = "runs/train", resume = "auto", progress = "auto";
  std::vector<std::string> sets;
  bool no_summary = false;
  int64_t nproc = 1;
  double checkpoint_every = 600;
};

void run_train(const TrainArgs& a) {
  spes::Config cfg = spes::config_load(a.config, a.sets);
  if (cfg.spes_config.mode != spes::SyncMode::Centralized) {
    spdlog::info("spes train runs one node that trains every expert (spes_config.mode '{}' "
                 "applies to `spes launch` and `spes node`)", cfg.spes_config.mode);
    cfg.spes_config.mode = spes::SyncMode::Centralized;
  }
  // A model larger than the machine is refused before the run directory (and its lock) exists.
  if (spes::select_device(cfg).is_cpu()) spes::check_model_fits_memory(cfg.model, "model");
  // One writer per run directory (the ranks of --nproc-per-node write under their parent's).
  std::optional<spes::RunDirLock> lock;
  if (!spes::running_as_rank()) lock.emplace(a.out);
  spes::install_stop_handlers();  // Ctrl-C / SIGTERM: checkpoint at the next step, then exit
  if (spes::cli::run_node_ranks(cfg, a.nproc)) return;  // started the ranks, which are done
  std::unique_ptr<spes::DistGroup> dist = spes::DistGroup::from_environment();
  spes::TrainerOptions opts;
  opts.resume_from = a.resume == "none" ? "" : a.resume;
  opts.progress = spes::progress_mode_from_string(a.progress);
  opts.dist = dist.get();
  opts.checkpoint_every_s = a.checkpoint_every;
  spes::Trainer trainer(cfg, a.out, opts, spes::init_checkpoint_weights(cfg.model));
  if (!trainer.is_rank0()) {  // the other ranks train silently
    trainer.run();
    spes::cli::end_if_stopped(trainer);
    return;
  }
  spdlog::info("model: {:.1f}M parameters ({:.1f}M trainable), {} steps of {} tokens, out {}",
               trainer.model().num_params() / 1e6, trainer.registry().trainable_numel() / 1e6,
               cfg.total_steps(), cfg.tokens_per_step(), a.out);
  const spes::EvalResult r = trainer.run();
  spes::cli::end_if_stopped(trainer);
  if (!a.no_summary) spes::cli::print_run_summary(trainer, r);
}

spes::cli::SubcommandRegistrar register_train("train", "Train a model on one node", [](CLI::App& sub) {
  auto a = std::make_shared<TrainArgs>();
  sub.add_option("--config", a->config, "YAML config (default: the built-in configs/default.yaml)");
  sub.add_option("--out", a->out, "Run directory (metrics.jsonl, checkpoint/)");
  spes::cli::add_set_option(sub, a->sets);
  spes::cli::add_training_options(sub, a->resume, a->progress, a->nproc,
                                  "the global batch is split");
  sub.add_option("--checkpoint-every", a->checkpoint_every,
                 "Also write OUT/checkpoint when this many seconds passed since the last one "
                 "(0: only every save_interval steps); Ctrl-C or SIGTERM writes one and exits")
      ->check(CLI::NonNegativeNumber);
  sub.add_flag("--no-summary", a->no_summary, "Skip the final baseline and sample");
  sub.callback([a] { run_train(*a); });
});

}  // namespace
