// `spes aggregate`: one sync round offline, with exactly the server's code: the kept uploads of
// a round (and the previous published model) in, the published model of that round out,
// including expert merging when the step is a merge point. After a handoff (ownership epochs)
// the round is aggregated under its epoch's map, read from the server's ownership.json
// (--ownership).
#include <spdlog/spdlog.h>

#include <fmt/ranges.h>

#include "cli/common_options.h"
#include "cli/command.h"
#include "spes/interop/init_checkpoint.h"
#include "spes/io/config.h"
#include "spes/io/files.h"
#include "spes/sync/round/aggregate.h"
#include "spes/sync/round/ownership_map.h"
#include "spes/sync/round/round_clock.h"
#include "spes/train/device.h"

namespace {

struct AggregateArgs {
  std::string config, out, previous, momentum, momentum_out, residual, residual_out, ownership;
  int64_t step = 0;
  std::vector<std::string> inputs, sets;
};

// compression: topk publishes topk(P_agg - P_prev + R): after round 1 the server's residual R
// of the previous round is needed (it keeps it in rounds/<round-1>/residual.safetensors).
void load_residual(const AggregateArgs& a, const spes::Config& cfg,
                   spes::sync::SyncModel& model) {
  const spes::sync::RoundClock clock(cfg);
  if (!model.sparse()) {
    SPES_CHECK(a.residual.empty() && a.residual_out.empty(), "--residual and --residual-out "
               "belong to spes_config.compression: topk (this config has {})",
               cfg.spes_config.transfer.compression);
    return;
  }
  const int64_t prev_round = clock.round_at(a.step) - 1;
  if (a.residual.empty()) {
    SPES_CHECK(prev_round == 0, "compression: topk after round 1 needs --residual: the server's "
               "residual after round {} (it keeps it in rounds/{}/residual.safetensors with "
               "--keep-uploads); without it the published model cannot be reproduced",
               prev_round, prev_round);
    return;
  }
  SPES_CHECK(model.load_sparse_residual(a.residual, prev_round, model.weights_sha256()),
             "'{}' is not the residual after round {} of the model given by --previous (it is "
             "missing, damaged, of another round or of another model): use "
             "rounds/{}/residual.safetensors of the same run", a.residual, prev_round,
             prev_round);
}

// The map of the round's ownership epoch (the config's map without --ownership): the server
// aggregated each round under the map of its epoch.
void use_round_ownership(const AggregateArgs& a, const spes::Config& cfg,
                         spes::sync::SyncModel& model) {
  if (a.ownership.empty()) return;
  const int64_t round = spes::sync::RoundClock(cfg).round_at(a.step);
  const auto [m, owners] = spes::sync::round_ownership_from_file(
      a.ownership, spes::Ownership::from_config(cfg), round);
  spdlog::info("round {}: ownership epoch {} (from round {}, map {})", round, m.epoch,
               m.from_round, m.fingerprint);
  if (m.epoch > 0) model.change_ownership(owners, m.epoch);
}

spes::sync::RoundOutcome aggregate(const AggregateArgs& a, spes::sync::SyncModel& model) {
  try {
    return spes::sync::aggregate_offline(model, a.inputs, a.step);
  } catch (const spes::sync::SyncError& e) {
    // An upload under a later ownership epoch than the config's map.
    if (!a.ownership.empty() || std::string(e.what()).find("ownership epoch") == std::string::npos)
      throw;
    spes::fail("{}\n(offline: a round after a handoff is aggregated under its epoch's map: give "
               "the server's ownership.json with --ownership)", e.what());
  }
}

void run_aggregate(const AggregateArgs& a) {
  const spes::Config cfg = spes::config_load(a.config, a.sets);
  spes::configure_threads(cfg);
  spes::sync::SyncModel model(cfg, spes::init_checkpoint_weights(cfg.model));
  if (a.previous.empty()) {
    spdlog::info("no --previous: starting from the initial model of seed {} (right for round 1)",
                 cfg.seed);
  } else {
    model.load(spes::safetensors_load(a.previous), a.previous);
  }
  if (!a.momentum.empty()) model.load_momentum(spes::safetensors_load(a.momentum), a.momentum);
  SPES_CHECK(!cfg.spes_config.uses_outer_step() || !a.momentum.empty() ||
                 a.step == spes::sync::RoundClock(cfg).step_of(1),
             "the outer step (mode diloco, or spes with outer_step) after round 1 needs "
             "--momentum (the server keeps it in rounds/<round-1>/momentum.safetensors)");
  use_round_ownership(a, cfg, model);
  load_residual(a, cfg, model);
  const spes::sync::RoundOutcome o = aggregate(a, model);
  const std::string sha = model.weights_sha256();
  if (!a.residual_out.empty()) model.save_sparse_residual(a.residual_out, o.round, sha);
  spes::sync::write_stream_file(a.out, spes::sync::published_writer(model, o.round, o.step, sha));
  if (!a.momentum_out.empty())
    spes::sync::write_stream_file(
        a.momentum_out, spes::sync::SafetensorsStreamWriter(
                            model.momentum_named(), torch::kFloat32,
                            {{"format", "spes-momentum-v1"}, {"round", std::to_string(o.round)}}));
  fmt::print("round {} (step {}): nodes [{}], alpha {:.6g}{}, model sha256 {}\nwrote {}\n",
             o.round, o.step, fmt::join(o.nodes, ", "), o.alpha, o.merged ? " (merged)" : "",
             sha, a.out);
}

spes::cli::SubcommandRegistrar register_aggregate("aggregate",
                                   "Apply one sync round offline to uploads kept by the server",
                                   [](CLI::App& sub) {
  auto a = std::make_shared<AggregateArgs>();
  sub.add_option("--config", a->config, "YAML config of the run (the server's)");
  sub.add_option("--step", a->step, "Step of the round (a multiple of sync_steps)")->required();
  sub.add_option("--out", a->out, "Output safetensors file (the published model)")->required();
  sub.add_option("--previous", a->previous,
                 "Published model of the previous round (default: the initial model)");
  sub.add_option("--momentum", a->momentum, "outer step: its momentum after the previous round");
  sub.add_option("--momentum-out", a->momentum_out, "outer step: write the new momentum");
  sub.add_option("--residual", a->residual,
                 "compression topk: the server's residual after the previous round");
  sub.add_option("--residual-out", a->residual_out, "compression topk: write the new residual");
  sub.add_option("--ownership", a->ownership,
                 "The server's ownership.json (DIR/ownership.json): the round is aggregated "
                 "under its ownership epoch's map (needed for rounds after a handoff)");
  spes::cli::add_set_option(sub, a->sets);
  sub.add_option("inputs", a->inputs, "Uploads of the round (node<i>.safetensors)")->required();
  sub.callback([a] { run_aggregate(*a); });
}, spes::cli::GpuUse::Never);

}  // namespace
