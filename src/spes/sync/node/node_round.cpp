// SyncNode's side of one round with the server (node.h): exchange() uploads the trainable
// tensors of a registry (the live one, or the copy of a round in flight), long-polls until the
// round is published, downloads what the node lacks (a delta with compression; a full download
// when the delta is refused or gives the wrong digest) and checks the published digest;
// catch_up() takes the latest published model whole when a round closed without this node.
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include "spes/common/strings.h"
#include "spes/sync/node/client.h"
#include "spes/sync/node/download.h"
#include "spes/sync/node/node.h"
#include "spes/sync/node/node_calls.h"
#include "spes/sync/round/plan.h"
#include "spes/sync/round/round_clock.h"
#include "spes/sync/wire/framing.h"

namespace spes::sync {

using node_detail::Clock;
using node_detail::since;

namespace {
// The longest long-poll while waiting for a round's publication: how soon a stop (Ctrl-C) is
// seen. One small call a second per waiting node (the server allows 20).
constexpr uint32_t kStopPollMs = 1000;
}  // namespace

RoundStatus SyncNode::wait_published(int64_t min_round) {
  const Config& cfg = trainer_->config();
  const double retry = cfg.spes_config.transport.retry_max_s;
  const auto tw = Clock::now();
  for (;;) {
    const auto tc = Clock::now();
    const RoundStatus st =
        call("wait for round", retry, [&] { return client_->wait_round(min_round, kMaxWaitMs); });
    if (st.published) return st;
    // The server answers at once when it holds no upload of ours (e.g. it restarted): this
    // node has none to give for this round, so poll gently.
    if (since(tc) < 1.0) std::this_thread::sleep_for(std::chrono::seconds(1));
    if (since(tw) > std::max(600.0, 2 * cfg.spes_config.timing.round_timeout))
      fail("node {}: round {} was not published within {:.0f} s", client_->id().node_id,
           min_round, since(tw));
  }
}

nlohmann::json SyncNode::catch_up(Trainer& t, int64_t min_round, const std::string& why) {
  const ParamRegistry& reg = t.registry();
  const WireDtype wire = wire_dtype_of(t.config().spes_config.transfer.dtype);
  const double retry = t.config().spes_config.transport.retry_max_s;
  const int64_t node = reg.node_id();
  const auto t0 = Clock::now();
  spdlog::warn("node {}: {}; taking the published model", node, why);
  for (int tries = 0;; ++tries) {
    // Wait until the round this node missed is published, then take the latest one.
    const RoundStatus st = wait_published(min_round);
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
    const nlohmann::json changed = adopt_caught_up_round(t, cur, sha);
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
            {"frozen_sha256_after", frozen_sha_},
            {"ownership", changed}};
  }
}

nlohmann::json SyncNode::adopt_caught_up_round(Trainer& t, const RoundStatus& cur,
                                               const std::string& sha) {
  const int64_t round = cur.published_round;
  t.state().step = cur.published_step > 0 ? cur.published_step
                                          : RoundClock(t.config()).step_of(round);
  t.state().sync_round = round;
  held_round_ = round;
  const nlohmann::json changed = apply_ownership(t, cur.ownership, nullptr, /*boundary=*/true);
  mark_synced(t, /*reset_residual=*/true, sha);
  return changed;
}


SafetensorsStreamWriter SyncNode::upload_payload(const ParamRegistry& reg,
                                                 const UploadMeta& meta, WireDtype wire) const {
  // With compression the payload is the quantised delta (hooks do not replace it).
  if (delta_->enabled()) return delta_->encode(reg, meta);
  if (opts_.hooks)
    if (std::optional<SafetensorsStreamWriter> p = opts_.hooks->payload(reg, meta, wire))
      return std::move(*p);
  return node_upload_writer(reg, meta, wire);
}

RoundExchange SyncNode::exchange(const ParamRegistry& reg, int64_t round, int64_t step,
                                 int64_t tokens) {
  const auto t0 = Clock::now();
  const WireDtype wire = wire_dtype_of(trainer_->config().spes_config.transfer.dtype);
  UploadMeta meta{reg.node_id(), round, step, tokens, client_->id().incarnation,
                  reg.fingerprint()};
  meta.ownership_epoch = ownership_epoch_;
  const SafetensorsStreamWriter payload = upload_payload(reg, meta, wire);
  RoundTimes times;
  UploadResult up;
  if (RoundExchange r = upload_round(round, step, payload, &up); r.needs_catch_up()) return r;
  times.upload_s = since(t0);
  const auto t1 = Clock::now();
  RoundStatus st;
  if (RoundExchange r = await_publication(round, step, payload, &up, &st); r.needs_catch_up())
    return r;
  if (RoundExchange r = check_published_with_upload(round, up, st); r.needs_catch_up()) return r;
  if (opts_.hooks)
    opts_.hooks->after_published(*client_, round, RoundClock(trainer_->config()), payload);
  times.wait_s = since(t1);
  const auto t2 = Clock::now();
  RoundDownload down;
  if (RoundExchange r = download_round(reg, round, st, &down); r.needs_catch_up()) return r;
  times.download_s = since(t2);
  SPES_CHECK(down.sha256 == st.model_sha256, "node {}: after loading round {} its weights hash "
             "to {} but the server published {} (the node and server disagree about the model)",
             reg.node_id(), round, down.sha256, st.model_sha256);
  held_round_ = round;
  const std::string frozen_after = frozen_weights_sha256(reg);
  // The round used this node's upload, or an earlier incarnation's (up.accepted false): that
  // one was this one when the delta gave the published digest, and the error feedback goes on
  // as if the node had not restarted; otherwise it restarts at zero, as after a catch-up.
  const bool unconfirmed = !up.accepted && !down.delta;
  if (unconfirmed)
    spdlog::warn("node {}: round {} was published with an earlier upload of this node (it "
                 "restarted), which the round's delta did not show to be this one: took the "
                 "whole model; its {} error feedback starts again at zero", reg.node_id(), round,
                 trainer_->config().spes_config.transfer.compression.name());
  if (delta_->enabled()) delta_->set_base(reg, /*reset_residual=*/unconfirmed, round, down.sha256);
  times.seconds = since(t0);
  log_round(reg.node_id(), meta, up, down, st, times);
  nlohmann::json record = round_record(meta, up, down, st, times, frozen_after);
  if (!up.accepted) record["earlier_upload"] = unconfirmed ? "unconfirmed" : "same";
  return {std::move(record), -1, "", st.ownership};
}

namespace {
RoundExchange catch_up_from(int64_t round, std::string why) {
  return RoundExchange{nullptr, round, std::move(why)};
}
}  // namespace

RoundExchange SyncNode::upload_round(int64_t round, int64_t step,
                                     const SafetensorsStreamWriter& payload, UploadResult* up) {
  try {
    *up = call("upload", trainer_->config().spes_config.transport.retry_max_s,
               [&] { return client_->upload(round, step, payload); });
  } catch (const SyncError& e) {
    if (e.code() == SyncErrc::OutOfRange)
      return catch_up_from(round, fmt::format("round {} closed without this node", round));
    if (e.code() == SyncErrc::InvalidArgument || e.code() == SyncErrc::ResourceExhausted)
      return catch_up_from(round, fmt::format("the server rejected its round {} upload: {}",
                                              round, e.what()));
    throw;
  }
  return {};
}

RoundExchange SyncNode::await_publication(int64_t round, int64_t step,
                                          const SafetensorsStreamWriter& payload,
                                          UploadResult* up, RoundStatus* st) {
  const SpesConfig& sc = trainer_->config().spes_config;
  const int64_t node = client_->id().node_id;
  const auto t1 = Clock::now();
  const double limit =
      opts_.round_wait_s > 0 ? opts_.round_wait_s : std::max(600.0, 2 * sc.timing.round_timeout);
  double last_log = 0;
  for (;;) {
    // Long-polls of at most kStopPollMs: a stop (SIGINT/SIGTERM) ends the wait soon.
    *st = call("wait for round", sc.transport.retry_max_s,
               [&] { return client_->wait_round(round, std::min(kMaxWaitMs, kStopPollMs)); });
    if (st->published) break;
    if (stopping_) fail("node {}: stopping while round {} is in flight", node, round);
    if (const int sig = stop_signal(); sig != 0)
      throw NodeStopped(fmt::format("node {}: stopped by {} while round {} waited for node(s) "
                                    "[{}]", node, signal_name(sig), round,
                                    fmt::join(st->waiting_for, ", ")));
    if (std::find(st->waiting_for.begin(), st->waiting_for.end(), node) !=
        st->waiting_for.end()) {
      // The server lacks this node's upload although it was accepted: the server restarted
      // and lost the round in progress. Send it again.
      spdlog::warn("node {}: the server no longer holds its round {} upload (restarted?); "
                   "sending it again", node, round);
      if (RoundExchange r = upload_round(round, step, payload, up); r.needs_catch_up()) return r;
      continue;
    }
    if (since(t1) > limit)
      fail("node {}: round {} was not published within {:.0f} s (waiting for node(s) [{}])",
           node, round, limit, fmt::join(st->waiting_for, ", "));
    if (since(t1) - last_log >= 30) {
      last_log = since(t1);
      spdlog::info("node {}: round {} waits for node(s) [{}] ({:.0f} s)", node, round,
                   fmt::join(st->waiting_for, ", "), since(t1));
    }
  }
  if (st->published_round != round)
    return catch_up_from(round, fmt::format("the server moved on to round {} while this node "
                                            "waited for round {}", st->published_round, round));
  return {};
}

RoundExchange SyncNode::check_published_with_upload(int64_t round, const UploadResult& up,
                                                    const RoundStatus& st) const {
  const int64_t node = client_->id().node_id;
  if (!up.accepted && !delta_->enabled())
    return catch_up_from(round, fmt::format("round {} already held an earlier upload of this "
                                            "node (restarted node)", round));
  if (std::find(st.nodes.begin(), st.nodes.end(), node) == st.nodes.end())
    return catch_up_from(round, fmt::format("round {} was published without this node's "
                                            "upload", round));
  return {};
}

RoundExchange SyncNode::download_round(const ParamRegistry& reg, int64_t round,
                                       const RoundStatus& st, RoundDownload* out) {
  // What the node lacks, resuming after interruptions; tensors it uploaded and does not get
  // back already hold the published value up to rounding to the transfer dtype, which is
  // applied here. With compression: the round's delta from the round the node holds, when it
  // holds the previous one (else the server sends the whole model); a delta that fails its
  // checks or gives the wrong digest is replaced by the whole model.
  const WireDtype wire = wire_dtype_of(trainer_->config().spes_config.transfer.dtype);
  const double retry = trainer_->config().spes_config.transport.retry_max_s;
  const uint64_t wire_down_before = client_->download_wire_bytes();
  auto superseded = [&] {
    return catch_up_from(round, fmt::format("round {} was superseded during the download",
                                            round));
  };
  // A compressed upload counts as the server rebuilt it: base + deq(q), bit for bit.
  if (delta_->enabled()) delta_->apply_rebuilt(reg);
  const int64_t from_round = delta_->enabled() && held_round_ == round - 1 ? held_round_ : -1;
  Download d(reg, round, Selection::ForNode, wire, delta_.get(), from_round);
  try {
    out->bytes = call("download", retry, [&] { return d.attempt(*client_); });
  } catch (const SyncError& e) {
    if (e.code() == SyncErrc::OutOfRange) return superseded();
    // A delta stream that fails its checks: take the whole model instead (below).
    if (from_round < 0 || e.code() != SyncErrc::InvalidArgument) throw;
    spdlog::warn("node {}: the round {} delta was refused ({}); downloading the whole model",
                 reg.node_id(), round, e.what());
    out->delta_refused = true;
  }
  if (!out->delta_refused) {
    if (!d.receiver.is_delta())
      for (const auto& e : reg.entries())
        if (e.trainable && !d.receiver.names().count(e.name)) wire_round_(e.tensor, wire);
    out->sha256 = reg.weights_sha256();
    out->delta = d.receiver.is_delta();
    if (out->sha256 != st.model_sha256 && out->delta) {
      // The delta did not give the published model (a hostile or broken stream, or a node
      // that did not hold what it thought): take the whole model instead.
      spdlog::warn("node {}: after applying the round {} delta its weights hash to {}, not the "
                   "published {}; downloading the whole model", reg.node_id(), round,
                   out->sha256.substr(0, 16), st.model_sha256.substr(0, 16));
      out->delta_refused = true;
    }
  }
  if (out->delta_refused) {
    out->delta = false;
    Download full(reg, round, Selection::All, wire);
    try {
      out->bytes += call("download", retry, [&] { return full.attempt(*client_); });
    } catch (const SyncError& e) {
      if (e.code() == SyncErrc::OutOfRange) return superseded();
      throw;
    }
    out->sha256 = reg.weights_sha256();
  }
  out->wire_bytes = client_->download_wire_bytes() - wire_down_before;
  return {};
}

void SyncNode::log_round(int64_t node, const UploadMeta& meta, const UploadResult& up,
                         const RoundDownload& down, const RoundStatus& st,
                         const RoundTimes& times) const {
  spdlog::info("node {}: round {} (step {}): up {}, down {}, upload {:.2f} s, wait {:.2f} s, "
               "download {:.2f} s{}, sha256 {}", node, meta.round, meta.step,
               human_bytes(static_cast<double>(up.bytes)),
               human_bytes(static_cast<double>(down.bytes)), times.upload_s, times.wait_s,
               times.download_s,
               st.alpha > 0 ? fmt::format(", merged (alpha {:.4g})", st.alpha) : "",
               down.sha256.substr(0, 16));
}

nlohmann::json SyncNode::round_record(const UploadMeta& meta, const UploadResult& up,
                                      const RoundDownload& down, const RoundStatus& st,
                                      const RoundTimes& times,
                                      const std::string& frozen_after) const {
  return {{"round", meta.round},
          {"step", meta.step},
          {"bytes_up", up.bytes},
          {"bytes_up_sent", up.bytes_sent},
          {"upload_resumed_from", up.resumed_from},
          {"bytes_down", down.bytes},
          {"bytes_down_wire", down.wire_bytes},
          {"download_delta", down.delta},
          {"delta_refused", down.delta_refused},
          {"model_sha256", down.sha256},
          {"alpha", st.alpha},
          {"tokens", meta.tokens},
          {"compression", trainer_->config().spes_config.transfer.compression.name()},
          {"upload_s", times.upload_s},
          {"wait_s", times.wait_s},
          {"download_s", times.download_s},
          {"seconds", times.seconds},
          {"frozen_sha256_after", frozen_after}};
}

}  // namespace spes::sync
