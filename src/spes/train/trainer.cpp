// The training loop (see trainer.h).
#include "spes/train/trainer.h"

#include <array>
#include <filesystem>

#include "spes/common/error.h"
#include "spes/common/sysinfo.h"
#include "spes/model/losses.h"
#include "spes/train/device.h"

namespace spes {
namespace fs = std::filesystem;

namespace {
int64_t data_nodes(const Config& cfg) {
  return cfg.spes_config.mode == "centralized" ? 1 : cfg.spes_config.num_peers;
}
}  // namespace

Trainer::Trainer(const Config& cfg, const std::string& out_dir, TrainerOptions opts)
    : cfg_(cfg), out_dir_(out_dir), opts_(std::move(opts)), device_(select_device(cfg)),
      autocast_(use_bf16_autocast(cfg, device_)) {
  configure_threads(cfg_);
  SPES_CHECK(!cfg_.data.paths.empty(), "config: data.paths is empty; prepare token shards with "
             "`spes prepare` and set data.paths to the output directory");
  fs::create_directories(out_dir_);
  const int64_t seq = cfg_.model.max_sequence_length;
  const int64_t nodes = data_nodes(cfg_);
  train_loader_ = std::make_unique<BatchLoader>(cfg_.data, seq, cfg_.seed, opts_.node_id, nodes,
                                                Split::Train);
  const int64_t vocab_hint = train_loader_->vocab_size_hint();
  SPES_CHECK(vocab_hint <= cfg_.model.vocab_size,
             "data was prepared with a vocabulary of {} tokens but model.vocab_size is {}; set "
             "model.vocab_size to at least {}", vocab_hint, cfg_.model.vocab_size, vocab_hint);
  if (cfg_.data.validation_fraction > 0 || !cfg_.data.validation_paths.empty())
    val_loader_ = std::make_unique<BatchLoader>(cfg_.data, seq, cfg_.seed, 0, 1, Split::Validation);

  model_ = std::make_unique<Transformer>(cfg_.model, device_);
  // Nodes may use different seeds for data; the init seed is the run seed (a SPES node
  // replaces these weights with the server's initial model anyway).
  model_->init_weights(static_cast<uint64_t>(cfg_.seed));
  ownership_ = std::make_unique<Ownership>(Ownership::from_config(cfg_));
  registry_ = std::make_unique<ParamRegistry>(*model_, cfg_, *ownership_, opts_.node_id);
  optimizer_ = std::make_unique<AdamW>(registry_->trainable(), cfg_.optimizer);
  // One gradient buffer per trainable tensor for the whole run: peak memory is weights +
  // gradients + moments + activations, so frozen experts save their gradient bytes too.
  optimizer_->use_persistent_grads();
  // The micro-batches of a step run one per core at once when there are several (CPU).
  workers_ = std::make_unique<MicroBatchWorkers>(
      *model_, registry_->trainable(),
      MicroBatchWorkers::workers_for(cfg_.grad_accum_steps(), device_));

  std::string resume = opts_.resume_from;
  if (resume == "auto") resume = fs::exists(out_dir_ + "/checkpoint/state.json")
                                     ? out_dir_ + "/checkpoint" : "";
  if (!resume.empty()) {
    state_ = checkpoint_load(resume, *registry_, optimizer_.get());
    train_loader_->restore(state_.loader);
  }
  metrics_ = std::make_unique<MetricsLog>(out_dir_ + "/metrics.jsonl", !resume.empty());
}

Trainer::~Trainer() = default;

nlohmann::json Trainer::train_step() {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t accum = cfg_.grad_accum_steps();
  const double lr = lr_at_step(cfg_, state_.step);
  std::vector<Batch> batches;  // read in order first: the data position does not depend on threads
  for (int64_t i = 0; i < accum; ++i)
    batches.push_back(train_loader_->next(cfg_.device_train_microbatch_size));
  std::vector<std::array<double, 5>> terms(accum);  // total, ce, lb, router_z, z
  workers_->run(accum, [&](const Transformer& model, int64_t i) {
    LossTerms t;
    {
      AutocastScope ac(autocast_);
      t = compute_losses(model, batches[i].tokens.to(device_), batches[i].targets.to(device_));
    }
    (t.total / static_cast<double>(accum)).backward();
    terms[i] = {t.total.item<double>(), t.ce.item<double>(), t.lb.item<double>(),
                t.router_z.item<double>(), t.z.item<double>()};
  });
  double loss = 0, ce = 0, lb = 0, rz = 0, z = 0;
  for (const auto& t : terms) {
    loss += t[0] / accum;
    ce += t[1] / accum;
    lb += t[2] / accum;
    rz += t[3] / accum;
    z += t[4] / accum;
  }
  nlohmann::json memory;
  if (!memory_logged_) {
    // What this node really holds for training, measured on the tensors (the SPES saving).
    int64_t grad_bytes = 0;
    for (const auto& e : registry_->entries())
      if (e.tensor.grad().defined()) grad_bytes += e.tensor.grad().nbytes();
    memory = {{"params_numel", model_->num_params()},
              {"trainable_numel", registry_->trainable_numel()},
              {"grad_bytes", grad_bytes},
              // gradient buffers of the threads that run micro-batches in parallel
              {"worker_grad_bytes", workers_->replica_grad_bytes()}};
  }
  const double grad_norm = optimizer_->step(lr, cfg_.max_grad_norm);
  if (!memory_logged_) {
    memory["optimizer_state_bytes"] = optimizer_->state_bytes();
    memory_logged_ = true;
  }
  optimizer_->zero_grad();
  state_.step += 1;
  state_.tokens += cfg_.tokens_per_step();
  state_.loader = train_loader_->state();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  nlohmann::json rec = {{"step", state_.step}, {"loss", loss}, {"ce", ce}, {"lb_loss", lb},
          {"router_z_loss", rz}, {"z_loss", z}, {"lr", lr}, {"grad_norm", grad_norm},
          {"tokens", state_.tokens},
          {"tokens_per_s", static_cast<double>(cfg_.tokens_per_step()) / secs},
          {"step_s", secs}, {"peak_rss_mb", peak_rss_mb()}};
  if (!memory.is_null()) rec["memory"] = memory;
  last_record_ = rec;
  return rec;
}

EvalResult Trainer::evaluate(int64_t max_batches) {
  EvalResult r;
  if (!val_loader_) return r;
  torch::NoGradGuard ng;
  val_loader_->reset();
  const int64_t mb = cfg_.device_train_microbatch_size;
  int64_t batches = (val_loader_->num_windows() + mb - 1) / mb;
  if (max_batches > 0) batches = std::min(batches, max_batches);
  double sum = 0;
  for (int64_t i = 0; i < batches; ++i) {
    const int64_t n = std::min(mb, val_loader_->num_windows() - i * mb);
    Batch b = val_loader_->next(std::max<int64_t>(n, 1));
    LossTerms t;
    {
      AutocastScope ac(autocast_);
      t = compute_losses(*model_, b.tokens.to(device_), b.targets.to(device_));
    }
    sum += t.ce.item<double>() * static_cast<double>(t.n_targets);
    r.tokens += t.n_targets;
  }
  r.loss = r.tokens > 0 ? sum / static_cast<double>(r.tokens) : 0;
  r.perplexity = std::exp(r.loss);
  return r;
}

void Trainer::save_checkpoint(const std::string& dir) const {
  checkpoint_save(dir, cfg_, *registry_, optimizer_.get(), state_);
}

EvalResult Trainer::run() {
  const int64_t total = cfg_.total_steps();
  if (opts_.observer) opts_.observer->on_start(*this);
  ProgressDisplay progress(state_.step, total, opts_.progress, opts_.progress_prefix);
  EvalResult last;
  bool evaluated_last = false;
  while (state_.step < total) {
    nlohmann::json rec = train_step();
    if (opts_.observer) {
      nlohmann::json extra = opts_.observer->after_step(*this, state_.step);
      if (extra.is_object()) rec.update(extra);
    }
    const bool final_step = state_.step == total;
    evaluated_last = false;
    double val = -1;
    if ((cfg_.eval_interval > 0 && state_.step % cfg_.eval_interval == 0) || final_step) {
      last = evaluate(cfg_.eval_batches);
      if (val_loader_) {
        rec["val_loss"] = last.loss;
        rec["val_ppl"] = last.perplexity;
        rec["val_tokens"] = last.tokens;
        val = last.loss;
      }
      evaluated_last = true;
    }
    metrics_->write(rec);
    progress.update(state_.step, rec["loss"].get<double>(), rec["tokens_per_s"].get<double>(), val);
    if (cfg_.save_interval > 0 && state_.step % cfg_.save_interval == 0 && !final_step)
      save_checkpoint(out_dir_ + "/checkpoint");
  }
  progress.finish();
  if (!evaluated_last) last = evaluate(cfg_.eval_batches);
  save_checkpoint(out_dir_ + "/checkpoint");
  if (opts_.observer) opts_.observer->on_finish(*this);
  return last;
}

}  // namespace spes
