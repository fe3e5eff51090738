// The training loop (see trainer.h).
#include "spes/train/trainer.h"

#include <signal.h>

#include <array>
#include <filesystem>
#include <optional>

#include <spdlog/spdlog.h>

#include "spes/common/cpu_blas.h"
#include "spes/common/error.h"
#include "spes/common/stop_signal.h"
#include "spes/common/sysinfo.h"
#include "spes/common/timing.h"
#include "spes/io/run_layout.h"
#include "spes/model/losses.h"
#include "spes/model/model_size_guard.h"
#include "spes/train/device.h"
#include "spes/train/memory_meter.h"
#include "spes/train/ownership_change.h"

namespace spes {
namespace fs = std::filesystem;

namespace {
int64_t data_nodes(const Config& cfg) {
  // With data.split_across_nodes, one slice per node id the run admits (arrivals included).
  return cfg.spes_config.mode == SyncMode::Centralized ? 1 : cfg.spes_config.node_slots();
}

// The figures of a step's metrics.jsonl line that go to TensorBoard, and their tags.
const std::vector<ScalarKey> kStepScalars = {
    {"loss", "train/loss"},         {"ce", "train/ce"},
    {"lb_loss", "train/lb_loss"},   {"z_loss", "train/z_loss"},
    {"router_z_loss", "train/router_z_loss"},
    {"lr", "train/lr"},             {"grad_norm", "train/grad_norm"},
    {"tokens_per_s", "train/tokens_per_s"}, {"step_s", "train/step_s"},
    {"tokens", "train/tokens"},     {"val_loss", "eval/loss"},
    {"val_ppl", "eval/perplexity"}};
}  // namespace

Trainer::Trainer(const Config& cfg, const std::string& out_dir, TrainerOptions opts,
                 std::optional<InitialWeights> initial)
    : cfg_(cfg), out_dir_(out_dir), opts_(std::move(opts)),
      device_(opts_.dist ? opts_.dist->device() : select_device(cfg)),
      autocast_(use_bf16_autocast(cfg, device_)) {
  check_settings();
  fs::create_directories(out_dir_);
  open_data();
  const std::string resume = checkpoint_to_resume();
  build_model(resume, std::move(initial));
  build_optimizer();
  restore_state(resume);
  open_logs(resume);
}

void Trainer::check_settings() const {
  configure_threads(cfg_);
  // Which BLAS and kernels serve the CPU's matrix products (a generic OpenBLAS core runs them
  // at a fraction of the machine's rate; common/cpu_blas.h).
  if (device_.is_cpu()) spdlog::info("CPU matrix products: {}", cpu_blas_summary());
  if (opts_.dist) {
    const int64_t per_rank = cfg_.device_train_microbatch_size * opts_.dist->size();
    SPES_CHECK(cfg_.global_train_batch_size % per_rank == 0, "global_train_batch_size ({}) must "
               "be a multiple of device_train_microbatch_size ({}) x the node's {} ranks",
               cfg_.global_train_batch_size, cfg_.device_train_microbatch_size,
               opts_.dist->size());
  }
  SPES_CHECK(!cfg_.data.paths.empty(), "config: data.paths is empty; prepare token shards with "
             "`spes prepare` and set data.paths to the output directory");
  // Before anything is written or allocated (the model built below checks it too).
  if (device_.is_cpu()) check_model_fits_memory(cfg_.model, "model");
}

void Trainer::open_data() {
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
}

std::string Trainer::checkpoint_to_resume() const {
  std::string resume = opts_.resume_from;
  const std::string checkpoint_dir = run_layout::checkpoint(out_dir_);
  if (is_rank0()) checkpoint_tidy(checkpoint_dir);
  if (resume == "auto")
    resume = fs::exists(run_layout::checkpoint_state(checkpoint_dir)) ? checkpoint_dir : "";
  return resume;
}

void Trainer::build_model(const std::string& resume, std::optional<InitialWeights> initial) {
  // A resumed run continues with the checkpoint's map (issue 38: it may differ from the
  // config's after experts changed hands), so the model is laid out for it from the start.
  auto recorded = resume.empty() ? std::nullopt
                                 : checkpoint_ownership(resume, cfg_.model.n_layers,
                                                        cfg_.model.is_moe()
                                                            ? cfg_.model.moe_num_experts
                                                            : 0);
  ownership_ = std::make_unique<Ownership>(recorded ? recorded->second
                                                    : Ownership::from_config(cfg_));
  if (recorded && recorded->first > 0 && is_rank0())
    spdlog::info("{}resuming with the checkpoint's ownership map (epoch {}, {})",
                 opts_.progress_prefix, recorded->first, ownership_->fingerprint());
  // The layout (grouped experts, bf16 frozen experts, checkpointing) follows the precision and
  // what this node trains.
  model_ = std::make_unique<Transformer>(
      cfg_.model, device_,
      model_runtime_for(cfg_, device_,
                        trainable_expert_table(cfg_, *ownership_, opts_.node_id)));
  // Nodes may use different seeds for data; the init seed is the run seed (a SPES node
  // replaces these weights with the server's initial model anyway).
  model_->init_weights(static_cast<uint64_t>(cfg_.seed), initial ? &*initial : nullptr);
  initial.reset();  // the model holds its own copy
  registry_ = std::make_unique<ParamRegistry>(*model_, cfg_, *ownership_, opts_.node_id);
}

void Trainer::build_optimizer() {
  optimizer_ = std::make_unique<AdamW>(registry_->trainable(), cfg_.optimizer);
  optimizer_->set_rewarmup_steps(rewarmup_steps_for(cfg_));
  // One gradient buffer per trainable tensor for the whole run: peak memory is weights +
  // gradients + moments + activations, so frozen experts save their gradient bytes too.
  optimizer_->use_persistent_grads();
  // The micro-batches of a step run one per core at once when there are several (CPU); the
  // ranks of a data-parallel node each run theirs one after the other.
  workers_ = std::make_unique<MicroBatchWorkers>(
      *model_, registry_->trainable(),
      opts_.dist ? 1 : MicroBatchWorkers::workers_for(cfg_.grad_accum_steps(), device_));
  if (opts_.dist)
    reducer_ = std::make_unique<GradientAllReduce>(*opts_.dist, *model_, *optimizer_);
}

void Trainer::restore_state(const std::string& resume) {
  if (!resume.empty()) {
    state_ = checkpoint_load(resume, *registry_, optimizer_.get());
    train_loader_->restore(state_.loader);
  }
  state_.ownership = *ownership_;
  if (opts_.dist) {  // every rank starts from rank 0's weights
    std::vector<torch::Tensor> all;
    for (const auto& e : registry_->entries()) all.push_back(e.tensor);
    broadcast_from_rank0(*opts_.dist, all);
  }
}

void Trainer::open_logs(const std::string& resume) {
  if (!is_rank0()) return;
  metrics_ = std::make_unique<MetricsLog>(run_layout::metrics(out_dir_));
  tensorboard_ = std::make_unique<TensorBoardWriter>(out_dir_);
  // A restart keeps the history and says where it continues from.
  if (metrics_->had_lines())
    metrics_->write({{"event", "restart"}, {"from_step", state_.step},
                     {"checkpoint", resume}, {"time", unix_time()}});
}

Trainer::~Trainer() = default;

QueuedStep Trainer::queue_step() {
  QueuedStep q;
  q.start = std::chrono::steady_clock::now();
  const int64_t accum = cfg_.grad_accum_steps();  // micro-batches of the step, all ranks
  const int64_t ranks = opts_.dist ? opts_.dist->size() : 1;
  const int64_t rank = opts_.dist ? opts_.dist->rank() : 0;
  const int64_t local = accum / ranks;  // this rank's: [rank * local, (rank + 1) * local)
  q.lr = lr_at_step(cfg_, state_.step);
  std::vector<Batch> batches;  // read in order first: the data position does not depend on threads
  for (int64_t i = 0; i < accum; ++i) {  // (every rank reads all: the same data position)
    Batch b = train_loader_->next(cfg_.device_train_microbatch_size);
    if (i / local != rank) continue;
    if (device_.is_cuda()) {  // copied from pinned memory without waiting for the device
      b.tokens = b.tokens.pin_memory().to(device_, /*non_blocking=*/true);
      b.targets = b.targets.pin_memory().to(device_, /*non_blocking=*/true);
    }
    batches.push_back(std::move(b));
  }
  // Loss terms stay on the device (total, ce, lb, router_z, z per micro-batch) and reach the
  // host with the gradient norm, in one copy that settle_step() reads.
  std::vector<torch::Tensor> terms(local);
  workers_->run(local, [&](const Transformer& model, int64_t i) {
    LossTerms t;
    {
      AutocastScope ac(autocast_, device_.type());
      t = compute_losses(model, batches[i].tokens.to(device_), batches[i].targets.to(device_));
    }
    // The last micro-batch's backward reduces gradients over the ranks as it goes.
    if (reducer_ && i == local - 1) reducer_->arm(t.block_inputs);
    (t.total / static_cast<double>(accum)).backward();
    terms[i] = torch::stack({t.total, t.ce, t.lb, t.router_z, t.z}).detach().to(torch::kFloat64);
  });
  torch::Tensor term_sums = torch::stack(terms).to(device_);  // [local, 5]
  if (reducer_)  // summed over every rank's micro-batches: [1, 5]
    term_sums = reducer_->finish(term_sums.sum(0, true));
  q.term_rows = term_sums.size(0);
  if (!memory_logged_) {
    // What this node really holds for training, measured on the tensors (the SPES saving).
    int64_t grad_bytes = 0;
    for (const auto& e : registry_->entries())
      if (e.tensor.grad().defined()) grad_bytes += e.tensor.grad().nbytes();
    q.memory = {{"params_numel", model_->num_params()},
                {"trainable_numel", registry_->trainable_numel()},
                {"grad_bytes", grad_bytes},
                // gradient buffers of the threads that run micro-batches in parallel
                {"worker_grad_bytes", workers_->replica_grad_bytes()},
                {"optimizer_state_bytes", optimizer_->state_bytes()}};
    memory_logged_ = true;
  }
  q.figures = StepFigures(optimizer_->step_queued(q.lr, cfg_.max_grad_norm, term_sums));
  optimizer_->zero_grad();
  state_.step += 1;
  state_.tokens += cfg_.tokens_per_step();
  state_.loader = train_loader_->state();
  q.step = state_.step;
  q.tokens = state_.tokens;
  q.queue_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - q.start).count();
  return q;
}

nlohmann::json Trainer::settle_step(const QueuedStep& q) {
  const auto wait_start = std::chrono::steady_clock::now();
  const torch::Tensor host = q.figures.values();  // [grad_norm, then 5 per row]
  const double* v = host.data_ptr<double>();
  const double grad_norm = v[0];
  AdamW::check_norm(grad_norm, q.step);
  const double accum = static_cast<double>(cfg_.grad_accum_steps());
  double loss = 0, ce = 0, lb = 0, rz = 0, z = 0;
  for (int64_t i = 0; i < q.term_rows; ++i) {  // in micro-batch order, as before
    const double* row = v + 1 + 5 * i;
    loss += row[0] / accum;
    ce += row[1] / accum;
    lb += row[2] / accum;
    rz += row[3] / accum;
    z += row[4] / accum;
  }
  // The step's time: queueing it (on CPU: all of its work) and waiting for its figures (on a
  // GPU: for the device to finish it). With steps queued ahead this adds up to the period.
  const double secs =
      q.queue_s +
      std::chrono::duration<double>(std::chrono::steady_clock::now() - wait_start).count();
  nlohmann::json rec = {{"step", q.step}, {"loss", loss}, {"ce", ce}, {"lb_loss", lb},
          {"router_z_loss", rz}, {"z_loss", z}, {"lr", q.lr}, {"grad_norm", grad_norm},
          {"tokens", q.tokens},
          {"tokens_per_s", static_cast<double>(cfg_.tokens_per_step()) / secs},
          {"step_s", secs}, {"peak_rss_mb", peak_rss_mb()},
          // wall clock (Unix seconds) and seconds since this process started training
          {"time", unix_time()},
          {"elapsed_s", seconds_since(started_)}};
  if (device_.is_cuda())  // tensor bytes at the peak on this GPU, since the process started
    rec["gpu_peak_allocated_mb"] = gpu_memory_stats(device_).peak_allocated / double(1 << 20);
  if (!q.memory.is_null()) rec["memory"] = q.memory;
  last_record_ = rec;
  return rec;
}

nlohmann::json Trainer::train_step() { return settle_step(queue_step()); }

EvalResult Trainer::evaluate(int64_t max_batches) {
  EvalResult r;
  if (!val_loader_) return r;
  torch::NoGradGuard ng;
  val_loader_->reset();
  const int64_t mb = cfg_.device_train_microbatch_size;
  int64_t batches = (val_loader_->num_windows() + mb - 1) / mb;
  if (max_batches > 0) batches = std::min(batches, max_batches);
  double sum = 0;
  const int64_t ranks = opts_.dist ? opts_.dist->size() : 1;
  const int64_t rank = opts_.dist ? opts_.dist->rank() : 0;
  for (int64_t i = 0; i < batches; ++i) {
    const int64_t n = std::min(mb, val_loader_->num_windows() - i * mb);
    Batch b = val_loader_->next(std::max<int64_t>(n, 1));
    if (i % ranks != rank) continue;  // the ranks share the batches
    LossTerms t;
    {
      AutocastScope ac(autocast_, device_.type());
      t = compute_losses(*model_, b.tokens.to(device_), b.targets.to(device_));
    }
    const int64_t targets = t.n_targets.item<int64_t>();
    sum += t.ce.item<double>() * static_cast<double>(targets);
    r.tokens += targets;
  }
  if (opts_.dist) {
    torch::Tensor both =
        torch::tensor({sum, static_cast<double>(r.tokens)}, torch::kFloat64).to(device_);
    opts_.dist->all_reduce_sum({both});
    both = both.to(torch::kCPU);
    sum = both[0].item<double>();
    r.tokens = static_cast<int64_t>(both[1].item<double>());
  }
  r.loss = r.tokens > 0 ? sum / static_cast<double>(r.tokens) : 0;
  r.perplexity = std::exp(r.loss);
  return r;
}

void Trainer::save_checkpoint(const std::string& dir) const {
  if (!is_rank0()) return;  // the ranks hold the same weights and moments
  TrainState st = state_;
  st.ownership = *ownership_;  // the map in force, whatever the state's holder did to it
  if (opts_.observer) opts_.observer->save_state(st);
  checkpoint_save(dir, cfg_, *registry_, optimizer_.get(), st);
}

Trainer::BoundaryDecision Trainer::decide_at_boundary() const {
  BoundaryDecision d;
  d.stop = stop_signal();
  d.checkpoint_due = opts_.checkpoint_every_s > 0 &&
                     std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                   last_checkpoint_).count() >=
                         opts_.checkpoint_every_s;
  if (!opts_.dist) return d;
  // The ranks must stop at the same step and checkpoint at the same steps (their collectives
  // pair up): a stop seen by any rank stops all; rank 0's clock decides the checkpoint.
  torch::Tensor v = torch::tensor({d.stop != 0 ? 1.0 : 0.0,
                                   is_rank0() && d.checkpoint_due ? 1.0 : 0.0},
                                  torch::kFloat64)
                        .to(device_);
  opts_.dist->all_reduce_sum({v});
  v = v.to(torch::kCPU);
  if (v[0].item<double>() > 0 && d.stop == 0) d.stop = SIGTERM;
  d.checkpoint_due = v[1].item<double>() > 0;
  return d;
}

EvalResult Trainer::run() {
  const int64_t total = cfg_.total_steps();
  if (opts_.observer) opts_.observer->on_start(*this);
  ProgressDisplay progress(state_.step, total, is_rank0() ? opts_.progress : ProgressMode::None,
                           opts_.progress_prefix);
  last_checkpoint_ = std::chrono::steady_clock::now();
  EvalResult last;
  bool evaluated_last = false;
  std::optional<QueuedStep> queued;
  int stop = 0;  // the signal that asked this run to stop at the next step boundary
  while (queued || (state_.step < total && stop == 0)) {
    BoundaryDecision at;
    if (stop == 0) at = decide_at_boundary();
    stop = stop != 0 ? stop : at.stop;
    if (!queued && stop != 0) break;  // nothing in flight: stop here
    if (!queued) queued = queue_step();
    const int64_t step = queued->step;
    const bool final_step = step == total;
    const bool eval_now = (cfg_.eval_interval > 0 && step % cfg_.eval_interval == 0) || final_step;
    const bool save_now =
        ((cfg_.save_interval > 0 && step % cfg_.save_interval == 0) || at.checkpoint_due) &&
        !final_step;
    // The next step goes to the device before this one's figures are read, so that the device
    // never waits for the host between steps, unless something must see this step's weights
    // first: the observer (a sync round may replace them), an evaluation, a checkpoint, a stop.
    std::optional<QueuedStep> next;
    if (!opts_.observer && !eval_now && !save_now && !final_step && stop == 0)
      next = queue_step();
    nlohmann::json rec = settle_step(*queued);
    queued = std::move(next);
    if (opts_.observer) {
      nlohmann::json extra = opts_.observer->after_step(*this, step);
      if (extra.is_object()) rec.update(extra);
    }
    evaluated_last = false;
    double val = -1;
    if (eval_now) {
      last = evaluate(cfg_.eval_batches);
      if (val_loader_) {
        rec["val_loss"] = last.loss;
        rec["val_ppl"] = last.perplexity;
        rec["val_tokens"] = last.tokens;
        val = last.loss;
      }
      evaluated_last = true;
    }
    if (metrics_) metrics_->write(rec);
    if (tensorboard_) tensorboard_->write(step, rec.value("time", unix_time()), rec, kStepScalars);
    progress.update(step, rec["loss"].get<double>(), rec["tokens_per_s"].get<double>(), val);
    if (save_now) {
      save_checkpoint(run_layout::checkpoint(out_dir_));
      last_checkpoint_ = std::chrono::steady_clock::now();
    }
  }
  if (stop != 0 && state_.step < total) {
    stop_early(stop, progress);
    return last;
  }
  progress.finish();
  if (!evaluated_last) last = evaluate(cfg_.eval_batches);
  save_checkpoint(run_layout::checkpoint(out_dir_));
  write_unreported();
  if (opts_.observer) opts_.observer->on_finish(*this);
  if (opts_.dist) check_ranks_agree();
  return last;
}

void Trainer::stop_early(int sig, ProgressDisplay& progress) {
  progress.finish();
  write_unreported();
  if (opts_.observer) opts_.observer->on_stop(*this);
  const std::string dir = run_layout::checkpoint(out_dir_);
  save_checkpoint(dir);
  stopped_by_ = sig;
  if (is_rank0())
    spdlog::warn("{}stopped by {} after step {} of {}; checkpoint of step {} written to {}",
                 opts_.progress_prefix, signal_name(sig), state_.step, cfg_.total_steps(),
                 state_.step, dir);
}

void Trainer::write_unreported() {
  if (!opts_.observer) return;
  nlohmann::json rec = opts_.observer->unreported(*this);
  if (!metrics_ || !rec.is_object() || rec.empty()) return;
  rec["step"] = state_.step;
  rec["time"] = unix_time();
  metrics_->write(rec);
}

void Trainer::check_ranks_agree() const {
  // The ranks must end with the same weights (rank 0's checkpoint stands for all of them).
  const std::string sha = registry_->weights_sha256();
  torch::Tensor mine = torch::from_blob(const_cast<char*>(sha.data()),
                                        {static_cast<int64_t>(sha.size())}, torch::kUInt8)
                           .clone();
  torch::Tensor rank0 = mine.to(device_);
  opts_.dist->broadcast(rank0);
  const bool same = torch::equal(rank0.to(torch::kCPU), mine);
  spdlog::info("rank {} of {}: final weights sha256 {}", opts_.dist->rank(), opts_.dist->size(),
               sha.substr(0, 16));
  SPES_CHECK(same, "rank {}: its weights differ from rank 0's at the end of the run (sha256 {})",
             opts_.dist->rank(), sha.substr(0, 16));
}

}  // namespace spes
