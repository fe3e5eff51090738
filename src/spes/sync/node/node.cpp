// SPES node sync observer (see node.h).
#include "spes/sync/node/node.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <random>
#include <set>
#include <thread>

#include <fmt/ranges.h>

#include "spes/common/strings.h"
#include "spes/io/files.h"
#include "spes/sync/node/client.h"
#include "spes/sync/node/download.h"
#include "spes/sync/node/node_calls.h"
#include "spes/sync/round/ownership_map.h"
#include "spes/sync/round/plan.h"
#include "spes/sync/round/round_clock.h"
#include "spes/sync/round/topk_feedback.h"
#include "spes/sync/wire/auth.h"
#include "spes/sync/wire/framing.h"

namespace spes::sync {

using node_detail::Clock;
using node_detail::since;
using node_detail::retryable;

namespace {
uint64_t random_incarnation() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

// At most kMaxHeartbeatLosses points for one heartbeat: when heartbeats failed for a while,
// keep every other point (the curve stays even).
void bound_losses(std::vector<LossPoint>* l) {
  while (l->size() > kMaxHeartbeatLosses) {
    size_t k = 0;
    for (size_t i = 0; i < l->size(); i += 2) (*l)[k++] = (*l)[i];
    l->resize(k);
  }
}

}  // namespace

std::string frozen_weights_sha256(const ParamRegistry& registry) {
  Sha256 h;
  for (const auto& e : registry.entries()) {
    if (e.trainable) continue;
    h.update(e.name.data(), e.name.size());
    torch::Tensor t = e.tensor.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    h.update(t.data_ptr(), t.numel() * sizeof(float));
  }
  return h.hex_digest();
}

SyncNode::SyncNode(NodeOptions opts) : opts_(std::move(opts)) {}
SyncNode::~SyncNode() {
  stopping_ = true;
  inflight_.reset();
  stop_heartbeats();
}

void SyncNode::stop_heartbeats() {
  {
    std::lock_guard<std::mutex> lk(hb_mu_);
    hb_stop_ = true;
  }
  hb_cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
}

JoinResult SyncNode::join_once() {
  Trainer& t = *trainer_;
  JoinInfo info = node_join_info(t.config(), t.registry(), client_->id(), step_.load());
  info.ownership_epoch = ownership_epoch_;
  info.ownership_fingerprint = t.ownership().fingerprint();
  info.precision = t.autocast() ? "amp_bf16" : "fp32";  // what its memory estimate depends on
  return client_->join(info);
}

void SyncNode::rejoin(double limit_s) {
  const auto start = Clock::now();
  double backoff = 0.2;
  for (;;) {
    try {
      join_once();
      return;
    } catch (const SyncError& e) {
      if (!retryable(e.code()) || since(start) + backoff > limit_s) throw;
      // A restarted server: as soon as it listens; a refusal: after the whole backoff.
      client_->wait_before_retry(backoff);
      backoff = std::min(trainer_->config().spes_config.transport.retry_backoff_max_s, backoff * 2);
    }
  }
}

void SyncNode::on_start(Trainer& t) {
  trainer_ = &t;
  step_ = t.state().step;
  ownership_epoch_ = t.state().ownership_epoch;
  SPES_CHECK(t.config().spes_config.mode != SyncMode::Centralized, "spes node: "
             "spes_config.mode is centralized; set it to spes, fedavg or diloco (the server uses "
             "the same config)");
  const auto t0 = Clock::now();
  connect(t);
  const JoinResult jr = join_server();
  heartbeat_ms_ = jr.heartbeat_interval_ms;
  const TransferSettings& transfer = t.config().spes_config.transfer;
  delta_ = std::make_unique<DeltaUpload>(transfer.compression, topk_params(transfer),
                                         transfer.topk_decay, topk_published_params(transfer),
                                         transfer.topk_unsent_in_weights);
  const bool keep = keeps_checkpoint(t, jr);
  const bool replay = !keep && replays_upload(t, jr);
  if (replay) replay_upload(t, jr);
  const HeldModel held = keep ? keep_checkpoint(t, jr) : take_published_model(t, jr);
  const nlohmann::json changed = apply_ownership(t, jr.ownership);
  mark_synced(t, /*reset_residual=*/!replay, held.sha256);
  // A replayed upload left its accumulator on the published model it took (a kept checkpoint's
  // weights hold theirs already).
  if (replay) train_on_unsent(t, t.state().step);
  if (keep && delta_->enabled()) {
    // The checkpoint's sync state belongs to the trainable set it was written with: a map that
    // changed at this join (the server's newer epoch) makes it another node's state.
    if (changed.is_null()) restore_sync_state(t);
    else spdlog::warn("node {}: its trainable set changed at this join (ownership epoch {}); "
                      "its checkpoint's compressed-sync state is dropped and starts afresh",
                      client_->id().node_id, ownership_epoch_);
  }
  t.state().sync_tensors.clear();  // kept in delta_ now
  // A kept checkpoint lies after the published round: its next upload counts the tokens since
  // that round, as it would have without the restart.
  if (keep)
    tokens_at_sync_ -= (t.state().step - jr.published_step) * t.config().tokens_per_step();
  join_record_ = join_record(t, jr, keep, held, since(t0));
  if (!changed.is_null()) join_record_["ownership"] = changed;
  spdlog::info("node {}: joined at round {} (step {}), loaded {} ({}), model sha256 {}",
               client_->id().node_id, jr.published_round, t.state().step,
               human_bytes(held.bytes_down),
               wire_dtype_name(wire_dtype_of(t.config().spes_config.transfer.dtype)),
               held.sha256.substr(0, 16));
  start_heartbeats();
  if (keep && round_pending(t)) join_record_["pending_round"] = pending_round(t);
}

bool SyncNode::round_pending(const Trainer& t) const {
  const RoundClock clock(t.config());
  return clock.is_sync_step(t.state().step) &&
         t.state().sync_round < clock.round_at(t.state().step);
}

nlohmann::json SyncNode::pending_round(Trainer& t) {
  const int64_t step = t.state().step;
  spdlog::info("node {}: its checkpoint was written at sync step {} before round {} was "
               "published: doing that round first", client_->id().node_id, step,
               RoundClock(t.config()).round_at(step));
  return sync_round(t, step);
}

void SyncNode::connect(Trainer& t) {
  const SyncTransport& tr = t.config().spes_config.transport;
  NodeId id{t.registry().node_id(), random_incarnation(), opts_.auth_token};
  ClientTls tls;
  tls.root_pem = read_pem(tr.tls_ca, "tls_ca");
  tls.cert_pem = read_pem(tr.tls_client_cert, "tls_client_cert");
  tls.key_pem = read_pem(tr.tls_client_key, "tls_client_key");
  tls.insecure = opts_.insecure;
  client_ = std::make_unique<SyncClient>(opts_.server, id, tls);
  client_->set_chunk_coding(t.config().spes_config.transfer.codes_chunks());
  if (opts_.hooks) client_->set_upload_filter(opts_.hooks->upload_filter());
}

JoinResult SyncNode::join_server() {
  const NodeId& id = client_->id();
  spdlog::info("node {}: joining sync server {} (incarnation {:x})", id.node_id, opts_.server,
               id.incarnation);
  return call("join", opts_.connect_timeout_s, [&] {
    if (!client_->wait_connected(std::min(5.0, opts_.connect_timeout_s)))
      sync_fail(SyncErrc::Unavailable, "cannot connect to sync server {} within {:.0f} s (is "
                "`spes serve` running there? --connect-timeout sets how long to keep trying)",
                opts_.server, opts_.connect_timeout_s);
    return join_once();
  });
}

bool SyncNode::keeps_checkpoint(Trainer& t, const JoinResult& jr) const {
  // Keep the checkpoint's weights only when they continue the latest published round: written
  // at that round's own step right after the node took it (its weights are the published
  // model, or with topk_unsent_in_weights that plus its accumulator, which the sync state
  // check below vouches for), inside the round, or at the next sync step before that round
  // was done (round_pending()). Otherwise take the published model and its step (a fresh
  // node, or others moved on).
  const RoundClock clock(t.config());
  const int64_t step = t.state().step;
  const bool continues =
      t.state().sync_round == jr.published_round &&
      ((step > 0 && step == jr.published_step &&
        (delta_->unsent_in_weights() || t.registry().weights_sha256() == jr.model_sha256)) ||
       clock.between_syncs(step, jr.published_step) ||
       step == clock.step_of(jr.published_round + 1));
  if (!continues || !delta_->enabled()) return continues;
  // A compressed upload is a delta from the published model, which a checkpoint taken inside
  // a round no longer holds: the node continues when its checkpoint saved the base and error
  // feedback of that round (save_state), else it takes the published model again.
  const std::string problem = sync_state_problem(t, jr.published_round, jr.model_sha256);
  if (problem.empty()) return true;
  spdlog::warn("node {}: its checkpoint at step {} continues round {}, but with "
               "spes_config.compression {} it needs the base of its next delta and {}: taking "
               "the published model (the steps since the round are lost)",
               client_->id().node_id, t.state().step, jr.published_round,
               t.config().spes_config.transfer.compression, problem);
  return false;
}

SyncNode::HeldModel SyncNode::keep_checkpoint(Trainer& t, const JoinResult& jr) const {
  spdlog::info("node {}: continuing from its checkpoint at step {} (after round {})",
               client_->id().node_id, t.state().step, jr.published_round);
  return {0, t.registry().weights_sha256()};
}

SyncNode::HeldModel SyncNode::take_published_model(Trainer& t, const JoinResult& jr) {
  const ParamRegistry& reg = t.registry();
  const int64_t node = client_->id().node_id;
  HeldModel held{0, reg.weights_sha256()};
  // A node that already holds the published model bit for bit needs no download: a fresh node
  // built from the server's config and seed at round 0 (or from the same
  // model.init_checkpoint), or one restarted on exactly that model. The digest is the check a
  // download ends with; on a slow link this saves a whole model (docs/PROTOCOL.md, Node).
  if (held.sha256 != jr.model_sha256) {
    Download d(reg, jr.published_round, Selection::All,
               wire_dtype_of(t.config().spes_config.transfer.dtype));
    held.bytes_down = call("initial download", t.config().spes_config.transport.retry_max_s,
                           [&] { return d.attempt(*client_); });
    held.sha256 = reg.weights_sha256();
    SPES_CHECK(held.sha256 == jr.model_sha256, "node {}: after loading round {} its weights hash "
               "to {} but the server published {}", node, jr.published_round, held.sha256,
               jr.model_sha256);
  }
  if (t.state().step != jr.published_step)
    spdlog::warn("node {}: its checkpoint is at step {} (round {}); the others published "
                 "round {} (step {}): taking that model and joining from there", node,
                 t.state().step, t.state().sync_round, jr.published_round, jr.published_step);
  t.state().step = jr.published_step;
  t.state().sync_round = jr.published_round;
  held_round_ = jr.published_round;
  return held;
}

void SyncNode::mark_synced(Trainer& t, bool reset_residual, const std::string& model_sha256) {
  step_ = t.state().step;
  frozen_sha_ = frozen_weights_sha256(t.registry());
  tokens_at_sync_ = t.state().tokens;
  if (delta_->enabled())
    delta_->set_base(t.registry(), reset_residual, t.state().sync_round, model_sha256);
}

nlohmann::json SyncNode::join_record(Trainer& t, const JoinResult& jr, bool kept,
                                     const HeldModel& held, double seconds) const {
  const ParamRegistry& reg = t.registry();
  int64_t grad_numel = 0;
  for (const auto& e : reg.entries())
    if (e.tensor.requires_grad()) grad_numel += e.tensor.numel();
  const UploadMeta probe{reg.node_id(), 0, 0, 0, client_->id().incarnation, reg.fingerprint()};
  const WireDtype wire = wire_dtype_of(t.config().spes_config.transfer.dtype);
  return {{"round", jr.published_round},
          {"step", t.state().step},
          {"resumed_from_checkpoint", kept},
          {"model_sha256", held.sha256},
          {"frozen_sha256", frozen_sha_},
          {"bytes_down", held.bytes_down},
          {"seconds", seconds},
          {"trainable_numel", reg.trainable_numel()},
          {"frozen_numel", reg.frozen_numel()},
          {"grad_numel", grad_numel},
          {"optimizer_state_bytes", t.optimizer().state_bytes()},
          {"ownership_epoch", ownership_epoch_},
          {"ownership_fingerprint", t.ownership().fingerprint()},
          {"compression", t.config().spes_config.transfer.compression.name()},
          {"upload_data_bytes", delta_->enabled()
                                    ? delta_->upload_data_bytes(reg)
                                    : node_upload_writer(reg, probe, wire).data_bytes()}};
}

void SyncNode::start_heartbeats() {
  // Heartbeats between syncs, so that the server can tell a slow node from a dead one.
  if (heartbeat_ms_ == 0) return;
  // After a failed heartbeat the next one goes as soon as the server is reachable again, so a
  // restarted server sees every node back within about a second of listening.
  heartbeat_ = std::thread([this] {
    std::unique_lock<std::mutex> lk(hb_mu_);
    const std::chrono::milliseconds interval(heartbeat_ms_);
    std::chrono::milliseconds wait = interval, after_failure(100);
    while (!hb_cv_.wait_for(lk, wait, [&] { return hb_stop_; })) {
      lk.unlock();
      const HeartbeatResult r = send_heartbeat();
      lk.lock();
      // Unreachable: again at once (send_heartbeat waited until the server listens, up to
      // half a second). Refused: after 0.1 s, doubling up to the interval (a server that
      // keeps refusing is not flooded).
      wait = r == HeartbeatResult::Sent          ? interval
             : r == HeartbeatResult::Unreachable ? std::chrono::milliseconds(0)
                                                 : std::min(interval, after_failure);
      after_failure = r == HeartbeatResult::Refused ? std::min(interval, after_failure * 2)
                                                    : std::chrono::milliseconds(100);
    }
  });
}

SyncNode::HeartbeatResult SyncNode::send_heartbeat() {
  NodeMetrics m;
  {
    std::lock_guard<std::mutex> ml(metrics_mu_);
    m = metrics_;
    metrics_.losses.clear();
  }
  try {
    try {
      client_->heartbeat(step_.load(), m);
    } catch (const SyncError& e) {
      if (e.code() != SyncErrc::NotJoined) throw;
      // The server restarted and answers "join first": join at once, then send it again.
      spdlog::warn("node {}: heartbeat: the server does not know this node (restarted?); "
                   "joining again", client_->id().node_id);
      join_once();
      client_->heartbeat(step_.load(), m);
    }
    return HeartbeatResult::Sent;
  } catch (const std::exception& e) {
    spdlog::debug("heartbeat failed: {}", e.what());
    {
      std::lock_guard<std::mutex> ml(metrics_mu_);  // the next heartbeat sends them
      metrics_.losses.insert(metrics_.losses.begin(), m.losses.begin(), m.losses.end());
      bound_losses(&metrics_.losses);
    }
    const auto* se = dynamic_cast<const SyncError*>(&e);
    if (!se || se->code() != SyncErrc::Unavailable) return HeartbeatResult::Refused;
    // Until the server is back: wait for it to listen (at most half a second here, so that
    // stopping the heartbeats never waits long).
    client_->wait_connected(0.5);
    return HeartbeatResult::Unreachable;
  }
}

nlohmann::json SyncNode::after_step(Trainer& t, int64_t step) {
  nlohmann::json out = nlohmann::json::object();
  step_ = step;
  record_metrics(t.last_step_record(), step);
  if (!join_record_.is_null()) out["sync_join"] = std::exchange(join_record_, nullptr);
  if (inflight_ && (step >= inflight_->deadline() ||
                    (t.config().spes_config.timing.overlap_delay_steps == 0 && inflight_->ready())))
    round_or_stop(&out, inflight_->round(), step, [&] { return settle_round(t, step); });
  // (A catch-up while settling may have moved the node to another step.)
  if (RoundClock(t.config()).is_sync_step(step) && t.state().step == step &&
      !out.contains("sync_stopped")) {
    SPES_CHECK(!inflight_, "internal: round {} is still in flight at sync step {}",
               inflight_->round(), step);
    const int64_t deadline = overlap_deadline(t, step);
    if (deadline > step)
      start_round(t, step, deadline);
    else
      round_or_stop(&out, RoundClock(t.config()).round_at(step), step,
                    [&] { return sync_round(t, step); });
  }
  step_ = t.state().step;
  return out;
}

void SyncNode::round_or_stop(nlohmann::json* out, int64_t round, int64_t step,
                             const std::function<nlohmann::json()>& f) {
  try {
    (*out)["sync"] = f();
  } catch (const NodeStopped& e) {
    // The trainer stops at this step boundary; the round stays undone (round_pending()).
    spdlog::warn("{}", e.what());
    (*out)["sync_stopped"] = {{"round", round}, {"step", step}};
  }
}

void SyncNode::record_metrics(const nlohmann::json& rec, int64_t step) {
  const auto value = [&](const char* key) {
    return rec.is_object() && rec.contains(key) && rec[key].is_number() ? rec[key].get<double>()
                                                                         : NAN;
  };
  std::lock_guard<std::mutex> lk(metrics_mu_);
  metrics_.loss = value("loss");
  metrics_.tokens_per_s = value("tokens_per_s");
  if (!std::isfinite(metrics_.loss)) return;
  metrics_.losses.push_back({step, metrics_.loss});
  bound_losses(&metrics_.losses);
}

std::string SyncNode::begin_round(Trainer& t, int64_t* tokens) {
  const std::string frozen_before = frozen_weights_sha256(t.registry());
  SPES_CHECK(frozen_before == frozen_sha_, "node {}: frozen experts changed between syncs "
             "(they must only change through a sync)", t.registry().node_id());
  *tokens = t.state().tokens - tokens_at_sync_;
  tokens_at_sync_ = t.state().tokens;
  return frozen_before;
}

int64_t SyncNode::overlap_deadline(const Trainer& t, int64_t step) const {
  const SpesConfig& sc = t.config().spes_config;
  if (!sc.timing.overlap) return step;
  // At the latest just before the next sync step (whose upload starts from the published
  // model), and at the run's last step.
  const int64_t delay = sc.timing.overlap_delay_steps > 0 ? sc.timing.overlap_delay_steps : sc.sync_steps - 1;
  return std::min(step + delay, t.config().total_steps());
}

nlohmann::json SyncNode::sync_round(Trainer& t, int64_t step) {
  const auto t0 = Clock::now();
  int64_t tokens = 0;
  const std::string frozen_before = begin_round(t, &tokens);
  const int64_t round = RoundClock(t.config()).round_at(step);
  RoundExchange x = exchange(t.registry(), round, step, tokens);
  if (x.needs_catch_up()) {
    x.record = catch_up(t, x.catch_up_round, x.why);
  } else {
    frozen_sha_ = x.record["frozen_sha256_after"].get<std::string>();
    t.state().sync_round = round;
    x.record["frozen_sha256_before"] = frozen_before;
    const nlohmann::json changed = apply_ownership(t, x.ownership, nullptr, /*boundary=*/true);
    if (!changed.is_null()) x.record["ownership"] = changed;
    train_on_unsent(t, step);
  }
  x.record["overlap"] = false;
  x.record["blocked_s"] = since(t0);
  return x.record;
}

void SyncNode::start_round(Trainer& t, int64_t step, int64_t deadline) {
  int64_t tokens = 0;
  const std::string frozen_before = begin_round(t, &tokens);
  const int64_t round = RoundClock(t.config()).round_at(step);
  inflight_ = std::make_unique<RoundInFlight>(
      t.registry(), round, step, deadline,
      [this, round, step, tokens, frozen_before](const ParamRegistry& copy) {
        RoundExchange x = exchange(copy, round, step, tokens);
        x.record["frozen_sha256_before"] = frozen_before;
        return x;
      },
      std::move(inflight_buffers_));
}

nlohmann::json SyncNode::settle_round(Trainer& t, int64_t step) {
  const auto t0 = Clock::now();
  const int64_t round = inflight_->round();
  const uint64_t held = inflight_->bytes();
  RoundExchange x;
  try {
    x = inflight_->wait();
  } catch (...) {
    inflight_.reset();
    throw;
  }
  nlohmann::json rec;
  if (x.needs_catch_up()) {
    inflight_buffers_ = inflight_->release();
    inflight_.reset();
    // The steps trained since the upload belong to a model the others did not build on.
    rec = catch_up(t, x.catch_up_round, x.why);
  } else {
    inflight_->apply(t.registry());
    frozen_sha_ = x.record["frozen_sha256_after"].get<std::string>();
    SPES_CHECK(frozen_weights_sha256(t.registry()) == frozen_sha_, "node {}: its frozen tensors "
               "differ from round {}'s after applying it", t.registry().node_id(), round);
    // A new map: lost experts take the round's value from the copy, before it is released.
    const nlohmann::json changed =
        apply_ownership(t, x.ownership, &inflight_->published(), /*boundary=*/true);
    inflight_buffers_ = inflight_->release();
    inflight_.reset();
    t.state().sync_round = round;
    rec = std::move(x.record);
    if (!changed.is_null()) rec["ownership"] = changed;
    train_on_unsent(t, step);
  }
  rec["overlap"] = true;
  rec["applied_step"] = step;
  rec["blocked_s"] = since(t0);
  rec["overlap_bytes"] = held;
  if (!x.needs_catch_up())
    spdlog::info("node {}: round {} applied after step {} (uploaded after step {}), waited "
                 "{:.2f} s", t.registry().node_id(), round, step, rec["step"].get<int64_t>(),
                 rec["blocked_s"].get<double>());
  return rec;
}

void SyncNode::train_on_unsent(Trainer& t, int64_t step) const {
  // After the run's last round the node keeps the published model: that is the run's result,
  // and what its final evaluation and checkpoint hold.
  if (step < t.config().total_steps()) delta_->add_unsent(t.registry());
}

nlohmann::json SyncNode::apply_ownership(Trainer& t, const OwnershipMap& m,
                                         const ParamRegistry* published, bool boundary) {
  if (m.empty()) return nullptr;  // a server that sends none (never: protocol 8)
  const Ownership& cur = t.ownership();
  const int64_t node = client_->id().node_id;
  const Ownership next = ownership_of(m, t.config().spes_config.node_slots(), cur.num_layers(),
                                      cur.num_experts(),
                                      fmt::format("node {}: the server's map", node));
  if (next.fingerprint() == cur.fingerprint()) {
    ownership_epoch_ = t.state().ownership_epoch = m.epoch;
    return nullptr;
  }
  std::set<std::string> before;
  for (const auto& e : t.registry().entries())
    if (e.trainable) before.insert(e.name);
  const nlohmann::json handed_over =
      boundary ? hand_over_lost_moments(t, next, m.epoch) : nlohmann::json();
  const ExpertMoments handed = fetch_handed_moments(t, next, m.epoch);
  t.change_ownership(next, handed.by_name.empty() ? nullptr : &handed);
  ownership_epoch_ = t.state().ownership_epoch = m.epoch;
  const ParamRegistry& reg = t.registry();
  int64_t gained = 0, lost = 0, trainable = 0;
  torch::NoGradGuard ng;
  for (const auto& e : reg.entries()) {
    const bool was = before.count(e.name) > 0;
    trainable += e.trainable ? 1 : 0;
    if (e.trainable && !was) ++gained;
    if (!e.trainable && was) {
      ++lost;
      // A lost expert holds the published value (overlap: it trained on since the upload).
      if (published && published != &reg) e.tensor.copy_(published->find(e.name)->tensor);
    }
  }
  std::vector<std::string> dropped;
  if (delta_->enabled()) dropped = delta_->change_trainable_set(reg, published ? *published : reg);
  frozen_sha_ = frozen_weights_sha256(reg);
  spdlog::warn("node {}: ownership epoch {} from round {} (map {}): trains {} tensors now ({} "
               "gained, {} lost{})", node, m.epoch, m.from_round, m.fingerprint,
               trainable, gained, lost,
               dropped.empty() ? "" : fmt::format(", {} residuals dropped", dropped.size()));
  nlohmann::json rec = {{"epoch", m.epoch}, {"from_round", m.from_round},
                        {"fingerprint", m.fingerprint}, {"gained_tensors", gained},
                        {"lost_tensors", lost}, {"residuals_dropped", dropped.size()},
                        {"trainable_numel", reg.trainable_numel()}};
  if (!handed.by_name.empty()) rec["handed_moments"] = handed_record(t, handed);
  if (!handed_over.is_null()) rec["handed_over"] = handed_over;
  return rec;
}

void SyncNode::on_stop(Trainer& t) {
  // A round in flight is dropped (its upload may still be published without this node's
  // progress since; the restarted node then takes that model). No leave: the node comes back.
  stopping_ = true;
  inflight_.reset();
  stopping_ = false;
  stop_heartbeats();
  if (opts_.depart && client_) {
    hand_over_moments(t);
    leave(t, LeaveKind::Departing, "departing (spes node --depart)");
  }
}

void SyncNode::leave(Trainer& t, LeaveKind kind, const std::string& reason) {
  try {
    call("leave", 30, [&] {
      client_->leave(t.state().step, reason, kind);
      return 0;
    });
    if (kind == LeaveKind::Departing)
      spdlog::warn("node {}: left the run for good at step {}; the server hands its experts to "
                   "live nodes", client_->id().node_id, t.state().step);
  } catch (const std::exception& e) {
    spdlog::warn("node {}: leave failed: {}", client_->id().node_id, e.what());
  }
}

nlohmann::json SyncNode::unreported(Trainer&) {
  if (join_record_.is_null()) return {};
  return {{"event", "sync_join"}, {"sync_join", std::exchange(join_record_, nullptr)}};
}

void SyncNode::on_finish(Trainer& t) {
  if (inflight_) {
    // The run's last step settles every round: this only ends one a failure left behind.
    stopping_ = true;
    inflight_.reset();
    stopping_ = false;
  }
  stop_heartbeats();
  if (client_) leave(t, LeaveKind::Finished, "finished");
}

}  // namespace spes::sync
