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
#include "spes/sync/round/plan.h"
#include "spes/sync/round/round_clock.h"
#include "spes/sync/wire/auth.h"
#include "spes/sync/wire/framing.h"

namespace spes::sync {

namespace {
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

bool retryable(SyncErrc c) {
  return c == SyncErrc::Unavailable || c == SyncErrc::DataLoss || c == SyncErrc::Aborted ||
         c == SyncErrc::DeadlineExceeded;
}

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
SyncNode::~SyncNode() { stop_heartbeats(); }

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
  const JoinInfo info = node_join_info(t.config(), t.registry(), client_->id(), t.state().step);
  return client_->join(info);
}

template <class F>
auto SyncNode::call(const char* what, double limit_s, F&& f) -> decltype(f()) {
  const auto start = Clock::now();
  double backoff = 0.2;
  const double max_backoff = trainer_->config().spes_config.retry_backoff_max_s;
  int rejoins = 0;
  for (int attempt = 1;; ++attempt) {
    try {
      return f();
    } catch (const SyncError& e) {
      if (e.code() == SyncErrc::NotJoined && rejoins < 5) {
        // The server restarted (or forgot us): join again with the same incarnation, then
        // repeat the call; the round logic (round ids) decides what still applies.
        ++rejoins;
        spdlog::warn("node {}: {}: the server does not know this node (restarted?); joining "
                     "again", client_->id().node_id, what);
        rejoin(limit_s);
        continue;
      }
      if (!retryable(e.code()) || since(start) + backoff > limit_s) throw;
      spdlog::warn("{} failed (attempt {}): {}; retrying in {:.1f} s", what, attempt, e.what(),
                   backoff);
      std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(backoff * 1000)));
      backoff = std::min(max_backoff, backoff * 2);
    }
  }
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
      std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(backoff * 1000)));
      backoff = std::min(trainer_->config().spes_config.retry_backoff_max_s, backoff * 2);
    }
  }
}

void SyncNode::on_start(Trainer& t) {
  trainer_ = &t;
  const Config& cfg = t.config();
  const ParamRegistry& reg = t.registry();
  SPES_CHECK(cfg.spes_config.mode != SyncMode::Centralized, "spes node: spes_config.mode is "
             "centralized; set it to spes, fedavg or diloco (the server uses the same config)");
  const WireDtype wire = wire_dtype_of(cfg.spes_config.transfer_dtype);
  NodeId id{reg.node_id(), random_incarnation(), opts_.auth_token};
  ClientTls tls;
  tls.root_pem = read_pem(cfg.spes_config.tls_ca, "tls_ca");
  tls.cert_pem = read_pem(cfg.spes_config.tls_client_cert, "tls_client_cert");
  tls.key_pem = read_pem(cfg.spes_config.tls_client_key, "tls_client_key");
  tls.insecure = opts_.insecure;
  client_ = std::make_unique<SyncClient>(opts_.server, id, tls);
  if (opts_.faults.any()) {
    faults_ = std::make_unique<NodeFaultInjection>(opts_.faults, id.node_id);
    client_->set_upload_filter(faults_->upload_filter());
  }
  const auto t0 = Clock::now();
  spdlog::info("node {}: joining sync server {} (incarnation {:x})", id.node_id, opts_.server,
               id.incarnation);
  const JoinResult jr = call("join", opts_.connect_timeout_s, [&] {
    if (!client_->wait_connected(std::min(5.0, opts_.connect_timeout_s)))
      sync_fail(SyncErrc::Unavailable, "cannot connect to sync server {} within {:.0f} s (is "
                "`spes serve` running there? --connect-timeout sets how long to keep trying)",
                opts_.server, opts_.connect_timeout_s);
    return join_once();
  });
  heartbeat_ms_ = jr.heartbeat_interval_ms;
  // Keep the checkpoint's weights only when they continue the latest published round;
  // otherwise take the published model and its step (a fresh node, or others moved on).
  const int64_t step = t.state().step;
  delta_ = std::make_unique<DeltaUpload>(cfg.spes_config.compression);
  const bool continues = t.state().sync_round == jr.published_round &&
                         RoundClock(cfg).between_syncs(step, jr.published_step);
  // A compressed upload is a delta from the published model, which a checkpoint taken inside
  // a round no longer holds: such a node takes the published model again.
  const bool keep = continues && !delta_->enabled();
  if (continues && !keep)
    spdlog::warn("node {}: its checkpoint at step {} continues round {}, but with "
                 "spes_config.compression {} it needs the published model as the base of its "
                 "next delta: taking it (the steps since the round are lost)", id.node_id, step,
                 jr.published_round, cfg.spes_config.compression);
  uint64_t down = 0;
  std::string sha;
  if (keep) {
    sha = reg.weights_sha256();
    spdlog::info("node {}: continuing from its checkpoint at step {} (after round {})",
                 id.node_id, step, jr.published_round);
  } else {
    Download d(reg, jr.published_round, Selection::All, wire);
    down = call("initial download", cfg.spes_config.retry_max_s, [&] {
      return d.attempt(*client_);
    });
    sha = reg.weights_sha256();
    SPES_CHECK(sha == jr.model_sha256, "node {}: after loading round {} its weights hash to {} "
               "but the server published {}", id.node_id, jr.published_round, sha,
               jr.model_sha256);
    if (step != jr.published_step)
      spdlog::warn("node {}: its checkpoint is at step {} (round {}); the others published "
                   "round {} (step {}): taking that model and joining from there", id.node_id,
                   step, t.state().sync_round, jr.published_round, jr.published_step);
    t.state().step = jr.published_step;
    t.state().sync_round = jr.published_round;
    held_round_ = jr.published_round;
  }
  step_ = t.state().step;
  frozen_sha_ = frozen_weights_sha256(reg);
  tokens_at_sync_ = t.state().tokens;
  if (delta_->enabled()) delta_->set_base(reg, /*reset_residual=*/true);
  int64_t grad_numel = 0;
  for (const auto& e : reg.entries())
    if (e.tensor.requires_grad()) grad_numel += e.tensor.numel();
  const UploadMeta probe{id.node_id, 0, 0, 0, id.incarnation, reg.fingerprint()};
  join_record_ = {{"round", jr.published_round},
                  {"step", t.state().step},
                  {"resumed_from_checkpoint", keep},
                  {"model_sha256", sha},
                  {"frozen_sha256", frozen_sha_},
                  {"bytes_down", down},
                  {"seconds", since(t0)},
                  {"trainable_numel", reg.trainable_numel()},
                  {"frozen_numel", reg.frozen_numel()},
                  {"grad_numel", grad_numel},
                  {"optimizer_state_bytes", t.optimizer().state_bytes()},
                  {"compression", cfg.spes_config.compression.name()},
                  {"upload_data_bytes", delta_->enabled()
                                            ? delta_->upload_data_bytes(reg)
                                            : node_upload_writer(reg, probe, wire).data_bytes()}};
  spdlog::info("node {}: joined at round {} (step {}), loaded {} ({}), model sha256 {}",
               id.node_id, jr.published_round, t.state().step, human_bytes(down),
               wire_dtype_name(wire), sha.substr(0, 16));
  // Heartbeats between syncs, so that the server can tell a slow node from a dead one.
  if (heartbeat_ms_ > 0)
    heartbeat_ = std::thread([this] {
      std::unique_lock<std::mutex> lk(hb_mu_);
      while (!hb_cv_.wait_for(lk, std::chrono::milliseconds(heartbeat_ms_),
                              [&] { return hb_stop_; })) {
        lk.unlock();
        NodeMetrics m;
        {
          std::lock_guard<std::mutex> ml(metrics_mu_);
          m = metrics_;
          metrics_.losses.clear();
        }
        try {
          client_->heartbeat(step_.load(), m);
        } catch (const std::exception& e) {
          spdlog::debug("heartbeat failed: {}", e.what());
          std::lock_guard<std::mutex> ml(metrics_mu_);  // the next heartbeat sends them
          metrics_.losses.insert(metrics_.losses.begin(), m.losses.begin(), m.losses.end());
          bound_losses(&metrics_.losses);
        }
        lk.lock();
      }
    });
}

nlohmann::json SyncNode::after_step(Trainer& t, int64_t step) {
  nlohmann::json out = nlohmann::json::object();
  step_ = step;
  record_metrics(t.last_step_record(), step);
  if (!join_record_.is_null()) {
    out["sync_join"] = join_record_;
    join_record_ = nullptr;
  }
  if (RoundClock(t.config()).is_sync_step(step)) out["sync"] = sync_round(t, step);
  step_ = t.state().step;
  return out;
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

nlohmann::json SyncNode::catch_up(Trainer& t, int64_t min_round, const std::string& why) {
  const Config& cfg = t.config();
  const ParamRegistry& reg = t.registry();
  const WireDtype wire = wire_dtype_of(cfg.spes_config.transfer_dtype);
  const int64_t node = reg.node_id();
  const double retry = cfg.spes_config.retry_max_s;
  const auto t0 = Clock::now();
  spdlog::warn("node {}: {}; taking the published model", node, why);
  for (int tries = 0;; ++tries) {
    // Wait until the round this node missed is published, then take the latest one.
    RoundStatus st;
    const auto tw = Clock::now();
    for (;;) {
      const auto tc = Clock::now();
      st = call("wait for round", retry, [&] { return client_->wait_round(min_round, kMaxWaitMs); });
      if (st.published) break;
      // The server answers at once when it holds no upload of ours (e.g. it restarted): this
      // node has none to give for this round, so poll gently.
      if (since(tc) < 1.0) std::this_thread::sleep_for(std::chrono::seconds(1));
      if (since(tw) > std::max(600.0, 2 * cfg.spes_config.round_timeout))
        fail("node {}: round {} was not published within {:.0f} s", node, min_round, since(tw));
    }
    const int64_t round = st.published_round;
    const RoundStatus cur = round == min_round && !st.model_sha256.empty()
                                ? st
                                : call("wait for round", retry,
                                       [&] { return client_->wait_round(round, 0); });
    if (cur.model_sha256.empty() && tries < 5) continue;  // a newer round meanwhile: again
    Download d(reg, round, Selection::All, wire);
    uint64_t down = 0;
    try {
      down = call("download", retry, [&] { return d.attempt(*client_); });
    } catch (const SyncError& e) {
      if (e.code() == SyncErrc::OutOfRange && tries < 5) continue;  // a newer round: again
      throw;
    }
    const std::string sha = reg.weights_sha256();
    SPES_CHECK(sha == cur.model_sha256, "node {}: after loading round {} its weights hash to {} "
               "but the server published {}", node, round, sha, cur.model_sha256);
    const int64_t from = t.state().step;
    t.state().step = cur.published_step > 0 ? cur.published_step
                                            : RoundClock(cfg).step_of(round);
    t.state().sync_round = round;
    held_round_ = round;
    frozen_sha_ = frozen_weights_sha256(reg);
    tokens_at_sync_ = t.state().tokens;
    if (delta_->enabled()) delta_->set_base(reg, /*reset_residual=*/true);
    spdlog::info("node {}: caught up with round {} (step {} -> {}), down {}, sha256 {}", node,
                 round, from, t.state().step, human_bytes(static_cast<double>(down)),
                 sha.substr(0, 16));
    return {{"round", round},
            {"step", t.state().step},
            {"caught_up", true},
            {"reason", why},
            {"bytes_up", 0},
            {"bytes_down", down},
            {"model_sha256", sha},
            {"alpha", cur.alpha},
            {"seconds", since(t0)},
            {"frozen_sha256_after", frozen_sha_}};
  }
}

nlohmann::json SyncNode::sync_round(Trainer& t, int64_t step) {
  const Config& cfg = t.config();
  const ParamRegistry& reg = t.registry();
  const WireDtype wire = wire_dtype_of(cfg.spes_config.transfer_dtype);
  const int64_t node = reg.node_id();
  const int64_t round = RoundClock(cfg).round_at(step);
  const double retry = cfg.spes_config.retry_max_s;
  const auto t0 = Clock::now();
  const std::string frozen_before = frozen_weights_sha256(reg);
  SPES_CHECK(frozen_before == frozen_sha_, "node {}: frozen experts changed between syncs "
             "(they must only change through a sync)", node);

  // 1. Upload the trainable tensors.
  const UploadMeta meta{node, round, step, t.state().tokens - tokens_at_sync_,
                        client_->id().incarnation, reg.fingerprint()};
  // With compression the payload is the quantised delta (value faults do not apply to it).
  const SafetensorsStreamWriter payload =
      delta_->enabled() ? delta_->encode(reg, meta)
      : faults_         ? faults_->payload(reg, meta, wire)
                        : node_upload_writer(reg, meta, wire);
  // Returns a catch-up record when the round can no longer take this node's upload.
  UploadResult up;
  auto upload = [&]() -> nlohmann::json {
    try {
      up = call("upload", retry, [&] { return client_->upload(round, step, payload); });
    } catch (const SyncError& e) {
      if (e.code() == SyncErrc::OutOfRange)
        return catch_up(t, round, fmt::format("round {} closed without this node", round));
      if (e.code() == SyncErrc::InvalidArgument || e.code() == SyncErrc::ResourceExhausted)
        return catch_up(t, round, fmt::format("the server rejected its round {} upload: {}",
                                              round, e.what()));
      throw;
    }
    return nullptr;
  };
  if (nlohmann::json r = upload(); !r.is_null()) return r;
  const double upload_s = since(t0);

  // 2. Long-poll until the round is published.
  const auto t1 = Clock::now();
  const double limit = opts_.round_wait_s > 0
                           ? opts_.round_wait_s
                           : std::max(600.0, 2 * cfg.spes_config.round_timeout);
  RoundStatus st;
  double last_log = 0;
  for (;;) {
    st = call("wait for round", retry, [&] { return client_->wait_round(round, kMaxWaitMs); });
    if (st.published) break;
    if (std::find(st.waiting_for.begin(), st.waiting_for.end(), node) != st.waiting_for.end()) {
      // The server lacks this node's upload although it was accepted: the server restarted
      // and lost the round in progress. Send it again.
      spdlog::warn("node {}: the server no longer holds its round {} upload (restarted?); "
                   "sending it again", node, round);
      if (nlohmann::json r = upload(); !r.is_null()) return r;
      continue;
    }
    if (since(t1) > limit)
      fail("node {}: round {} was not published within {:.0f} s (waiting for node(s) [{}])",
           node, round, limit, fmt::join(st.waiting_for, ", "));
    if (since(t1) - last_log >= 30) {
      last_log = since(t1);
      spdlog::info("node {}: round {} waits for node(s) [{}] ({:.0f} s)", node, round,
                   fmt::join(st.waiting_for, ", "), since(t1));
    }
  }
  if (st.published_round != round)
    return catch_up(t, round, fmt::format("the server moved on to round {} while this node "
                                          "waited for round {}", st.published_round, round));
  const bool used = std::find(st.nodes.begin(), st.nodes.end(), node) != st.nodes.end();
  if (!used || !up.accepted)
    return catch_up(t, round, !up.accepted
                                  ? fmt::format("round {} already held an earlier upload of "
                                                "this node (restarted node)", round)
                                  : fmt::format("round {} was published without this node's "
                                                "upload", round));
  if (faults_) faults_->after_published(*client_, round, RoundClock(cfg), payload);
  const double wait_s = since(t1);

  // 3. Download what the node lacks (resuming after interruptions); tensors it uploaded and
  // does not get back already hold the published value up to rounding to the transfer dtype,
  // which we apply here. With compression: the round's delta from the round the node holds,
  // when it holds the previous one (else the server sends the whole model).
  const auto t2 = Clock::now();
  // A compressed upload counts as the server rebuilt it: base + deq(q), bit for bit.
  if (delta_->enabled()) delta_->apply_rebuilt(reg);
  const int64_t from_round = delta_->enabled() && held_round_ == round - 1 ? held_round_ : -1;
  Download d(reg, round, Selection::ForNode, wire, delta_.get(), from_round);
  uint64_t down = 0;
  bool delta_refused = false;
  std::string sha;
  auto superseded = [&] {
    return catch_up(t, round, fmt::format("round {} was superseded during the download", round));
  };
  try {
    down = call("download", retry, [&] { return d.attempt(*client_); });
  } catch (const SyncError& e) {
    if (e.code() == SyncErrc::OutOfRange) return superseded();
    // A delta stream that fails its checks: take the whole model instead (below).
    if (from_round < 0 || e.code() != SyncErrc::InvalidArgument) throw;
    spdlog::warn("node {}: the round {} delta was refused ({}); downloading the whole model",
                 node, round, e.what());
    delta_refused = true;
  }
  if (!delta_refused) {
    if (!d.receiver.is_delta())
      for (const auto& e : reg.entries())
        if (e.trainable && !d.receiver.names().count(e.name)) wire_round_(e.tensor, wire);
    sha = reg.weights_sha256();
    if (sha != st.model_sha256 && d.receiver.is_delta()) {
      // The delta did not give the published model (a hostile or broken stream, or a node
      // that did not hold what it thought): take the whole model instead.
      spdlog::warn("node {}: after applying the round {} delta its weights hash to {}, not the "
                   "published {}; downloading the whole model", node, round, sha.substr(0, 16),
                   st.model_sha256.substr(0, 16));
      delta_refused = true;
    }
  }
  if (delta_refused) {
    Download full(reg, round, Selection::All, wire);
    try {
      down += call("download", retry, [&] { return full.attempt(*client_); });
    } catch (const SyncError& e) {
      if (e.code() == SyncErrc::OutOfRange) return superseded();
      throw;
    }
    sha = reg.weights_sha256();
  }
  const double download_s = since(t2);

  SPES_CHECK(sha == st.model_sha256, "node {}: after loading round {} its weights hash to {} but "
             "the server published {} (the node and server disagree about the model)", node,
             round, sha, st.model_sha256);
  held_round_ = round;
  const std::string frozen_after = frozen_weights_sha256(reg);
  frozen_sha_ = frozen_after;
  if (delta_->enabled()) delta_->set_base(reg, /*reset_residual=*/false);
  tokens_at_sync_ = t.state().tokens;
  t.state().sync_round = round;
  spdlog::info("node {}: round {} (step {}): up {}, down {}, upload {:.2f} s, wait {:.2f} s, "
               "download {:.2f} s{}, sha256 {}", node, round, step,
               human_bytes(static_cast<double>(up.bytes)), human_bytes(static_cast<double>(down)),
               upload_s, wait_s, download_s,
               st.alpha > 0 ? fmt::format(", merged (alpha {:.4g})", st.alpha) : "",
               sha.substr(0, 16));
  return {{"round", round},
          {"step", step},
          {"bytes_up", up.bytes},
          {"bytes_up_sent", up.bytes_sent},
          {"upload_resumed_from", up.resumed_from},
          {"bytes_down", down},
          {"download_delta", d.receiver.is_delta() && !delta_refused},
          {"delta_refused", delta_refused},
          {"model_sha256", sha},
          {"alpha", st.alpha},
          {"tokens", meta.tokens},
          {"compression", cfg.spes_config.compression.name()},
          {"upload_s", upload_s},
          {"wait_s", wait_s},
          {"download_s", download_s},
          {"seconds", since(t0)},
          {"frozen_sha256_before", frozen_before},
          {"frozen_sha256_after", frozen_after}};
}

void SyncNode::on_finish(Trainer& t) {
  stop_heartbeats();
  if (!client_) return;
  try {
    call("leave", 30, [&] {
      client_->leave(t.state().step, "finished");
      return 0;
    });
  } catch (const std::exception& e) {
    spdlog::warn("node {}: leave failed: {}", client_->id().node_id, e.what());
  }
}

}  // namespace spes::sync
