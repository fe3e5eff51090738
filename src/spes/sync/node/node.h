// A SPES node's sync client as a Trainer StepObserver. on_start: connect and join (retrying with
// bounded backoff while the server is unreachable), then either keep the weights of its own
// checkpoint (taken after the latest published round) or load the server's latest published
// model and move to its step (fresh node, or a restarted node whose checkpoint is older than
// what the others have published). A background thread sends heartbeats with the node's last
// loss and throughput and the losses of the steps since the previous one. Every sync_steps
// steps, after the optimizer step: upload the trainable tensors, long-poll until the round is
// published, download what the node lacks (resuming from the offset reached after an
// interruption), check that its weights hash to the published digest, and report
// {"sync": {round, bytes_up, bytes_down, model_sha256, ...}} for the metrics line. When the
// round closed without this node (it was late, its upload was rejected, or the server moved
// on), the node catches up: it takes the latest published model and its step. Any call that
// finds the server restarted (unknown incarnation) joins again and carries on. Optimizer
// moments are kept (reference behaviour). With spes_config.overlap the round runs in the
// background on a copy of the weights while training goes on (round_in_flight.h), and is
// applied at the first step boundary after it ends (or exactly overlap_delay_steps steps after
// the upload), at the latest just before the next sync step; a catch-up is always done in the
// foreground. The round at the run's last step blocks, so a run ends on a published model.
// on_finish: leave. A stop (SIGINT/SIGTERM, common/stop_signal.h) ends a wait for the server
// (NodeStopped): a foreground round is abandoned before its download (the checkpoint then
// holds the weights it uploaded, at the sync step, and the restarted node does that round
// first), a round in flight is dropped; the node does not leave (it comes back). With
// compression the checkpoint also holds the base and error feedback of the last published
// model the node took (node_checkpoint.cpp), so a node that continues its checkpoint continues
// its deltas exactly.
#pragma once
#include <nlohmann/json.hpp>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "spes/sync/round/delta_upload.h"
#include "spes/sync/node/round_hooks.h"
#include "spes/sync/node/round_in_flight.h"
#include "spes/sync/wire/protocol.h"
#include "spes/train/trainer.h"

namespace spes::sync {

class SyncClient;

// Thrown when a stop was requested (SIGINT/SIGTERM) while the node waited for the server.
class NodeStopped : public std::runtime_error {
 public:
  explicit NodeStopped(const std::string& what) : std::runtime_error(what) {}
};

struct NodeOptions {
  std::string server = "127.0.0.1:50551";  // host:port of `spes serve`
  double connect_timeout_s = 120;          // keep retrying this long while the server is down
                                           // at start (later: spes_config.retry_max_s)
  double round_wait_s = 0;                 // give up waiting for a round (0: max(600, 2 x
                                           // spes_config.round_timeout))
  std::string auth_token;                  // this node's secret (never logged)
  bool insecure = false;                   // allow plaintext to a non-loopback server
  std::shared_ptr<NodeRoundHooks> hooks;   // none in production (round_hooks.h)
  // `spes node --depart`: a stop (SIGINT/SIGTERM) leaves the run for good (Leave "departing":
  // the server hands this node's experts to live nodes) instead of coming back later.
  bool depart = false;
};

class SyncNode : public StepObserver {
 public:
  explicit SyncNode(NodeOptions opts);
  ~SyncNode() override;
  void on_start(Trainer& t) override;
  nlohmann::json after_step(Trainer& t, int64_t step) override;
  void on_finish(Trainer& t) override;
  // The join record when no step carried it (a node that joined at the run's last step, or
  // was stopped before its first): {"event": "sync_join", "sync_join": {...}}.
  nlohmann::json unreported(Trainer& t) override;
  void on_stop(Trainer& t) override;
  // With compression: the base and error feedback as of the last published model the node
  // took (sync.safetensors) and that round and digest (extra["sync"]).
  void save_state(TrainState& s) override;

 private:
  // on_start's steps: the client and its TLS; the join (retrying while the server is down);
  // whether the checkpoint continues the latest published round; the model the node then holds
  // (its checkpoint's, or the published one, downloaded unless it already has it); the state a
  // round starts from; the join's record for metrics.jsonl; the heartbeat thread.
  struct HeldModel {
    uint64_t bytes_down = 0;
    std::string sha256;
  };
  void connect(Trainer& t);
  JoinResult join_server();
  bool keeps_checkpoint(Trainer& t, const JoinResult& jr) const;
  // A checkpoint written by a stop at a sync step, before its round was published: the node
  // does that round first (its upload again) when it comes back.
  bool round_pending(const Trainer& t) const;
  nlohmann::json pending_round(Trainer& t);
  HeldModel keep_checkpoint(Trainer& t, const JoinResult& jr) const;
  HeldModel take_published_model(Trainer& t, const JoinResult& jr);
  // The node holds a published model now (digest `model_sha256`): its frozen digest, the
  // tokens count and the base of compressed uploads start from here.
  void mark_synced(Trainer& t, bool reset_residual, const std::string& model_sha256);
  // spes_config.topk_unsent_in_weights: after a round taken at `step` (its trainable set
  // settled) the node trains on the published model plus what it has not sent, except after
  // the run's last round.
  void train_on_unsent(Trainer& t, int64_t step) const;
  // node_checkpoint.cpp: why the checkpoint's sync state cannot continue published `round`
  // (its digest `model_sha256`; empty: not checked), or "" when it can.
  std::string sync_state_problem(const Trainer& t, int64_t round,
                                 const std::string& model_sha256) const;
  // Takes the checkpoint's sync state back; one that does not match the model is refused
  // (an Error naming the tensor and how to continue without it).
  void restore_sync_state(Trainer& t);
  // A checkpoint written at a sync step after its upload, whose round the server published
  // with it: the node encodes that upload again from its saved state (keeping what it did not
  // send) before it takes the published model.
  bool replays_upload(const Trainer& t, const JoinResult& jr) const;
  void replay_upload(Trainer& t, const JoinResult& jr);
  nlohmann::json join_record(Trainer& t, const JoinResult& jr, bool kept,
                             const HeldModel& held, double seconds) const;
  void start_heartbeats();
  enum class HeartbeatResult { Sent, Unreachable, Refused };
  HeartbeatResult send_heartbeat();
  // A round in the foreground: the node waits for it.
  nlohmann::json sync_round(Trainer& t, int64_t step);
  // after_step's round (settling one in flight, or one in the foreground) into out["sync"],
  // or, when a stop ended the wait, out["sync_stopped"].
  void round_or_stop(nlohmann::json* out, int64_t round, int64_t step,
                     const std::function<nlohmann::json()>& f);
  // With overlap: starts the round of sync step `step` in the background.
  void start_round(Trainer& t, int64_t step, int64_t deadline);
  // With overlap: waits for the round in flight and applies it (or catches up).
  nlohmann::json settle_round(Trainer& t, int64_t step);
  // The step until which the round of sync step `step` may stay in flight (== step: none, the
  // round blocks).
  int64_t overlap_deadline(const Trainer& t, int64_t step) const;
  // What the round's upload carries: checks that the frozen tensors did not change since the
  // last sync and returns their digest; counts the tokens since the last sync.
  std::string begin_round(Trainer& t, int64_t* tokens);
  // One round with the server on `reg` (the live registry, or the copy of a round in flight):
  // upload, wait for publication, download, digest check. Touches no trainer state.
  RoundExchange exchange(const ParamRegistry& reg, int64_t round, int64_t step, int64_t tokens);
  // exchange()'s steps; each returns a catch-up when the round can no longer use this node.
  struct RoundTimes {
    double upload_s = 0, wait_s = 0, download_s = 0, seconds = 0;
  };
  struct RoundDownload {
    uint64_t bytes = 0, wire_bytes = 0;
    bool delta = false, delta_refused = false;  // applied a delta / fell back to the model
    std::string sha256;                         // of the weights afterwards
  };
  RoundExchange upload_round(int64_t round, int64_t step, const SafetensorsStreamWriter& payload,
                             UploadResult* up);
  // Long-polls until the round is published (sending the upload again to a server that lost
  // it); a catch-up when the server moved past it.
  RoundExchange await_publication(int64_t round, int64_t step,
                                  const SafetensorsStreamWriter& payload, UploadResult* up,
                                  RoundStatus* st);
  // A catch-up unless the round was published with this node's upload. With compression an
  // earlier incarnation's upload (a node restarted after uploading) counts when this one is
  // the same: the delta then gives the published digest (else the whole model is taken and
  // the error feedback restarts, see exchange()).
  RoundExchange check_published_with_upload(int64_t round, const UploadResult& up,
                                            const RoundStatus& st) const;
  RoundExchange download_round(const ParamRegistry& reg, int64_t round, const RoundStatus& st,
                               RoundDownload* out);
  void log_round(int64_t node, const UploadMeta& meta, const UploadResult& up,
                 const RoundDownload& down, const RoundStatus& st, const RoundTimes& times) const;
  nlohmann::json round_record(const UploadMeta& meta, const UploadResult& up,
                              const RoundDownload& down, const RoundStatus& st,
                              const RoundTimes& times, const std::string& frozen_after) const;
  // What the round's upload carries: the compressed delta, a hook's payload, or the trainable
  // tensors in the wire dtype.
  SafetensorsStreamWriter upload_payload(const ParamRegistry& reg, const UploadMeta& meta,
                                         WireDtype wire) const;
  // Takes the latest published round (at least `min_round`) whole and moves the trainer to its
  // step. Returns the sync record.
  nlohmann::json catch_up(Trainer& t, int64_t min_round, const std::string& why);
  // Long-polls until a round >= min_round is published (fails after max(600 s, 2 x
  // round_timeout)).
  RoundStatus wait_published(int64_t min_round);
  // The trainer moves to the caught-up round `cur` (its step, map and sync state; the
  // compressed-sync feedback restarts). Returns the ownership change, if any.
  nlohmann::json adopt_caught_up_round(Trainer& t, const RoundStatus& cur,
                                       const std::string& sha);
  // Runs f, retrying transient failures with bounded backoff and joining again when the
  // server no longer knows this node.
  template <class F>
  auto call(const char* what, double limit_s, F&& f) -> decltype(f());
  JoinResult join_once();
  void rejoin(double limit_s);  // join again (same incarnation), retrying transient failures
  void stop_heartbeats();
  void leave(Trainer& t, LeaveKind kind, const std::string& reason);
  // node_handoff.cpp (protocol 9). Departing: the AdamW moments of the experts this node owns
  // go to the server (a failure is logged: their next owners then start at zero moments).
  void hand_over_moments(Trainer& t);
  // Gaining experts under map `next` (epoch `epoch`): the moments handed over for them (empty:
  // none, or the fetch failed, logged).
  ExpertMoments fetch_handed_moments(const Trainer& t, const Ownership& next, int64_t epoch);
  // Protocol 10: losing experts under map `next` (epoch `epoch`, the one after the node's) at a
  // round boundary: their AdamW moments go to the server as a "lost" handover, for the arrival
  // that takes them (a failure or a refusal is logged: that arrival starts them at zero).
  // Returns the sync record's "handed_over" entry (moments_record; null: nothing lost).
  nlohmann::json hand_over_lost_moments(const Trainer& t, const Ownership& next, int64_t epoch);
  // At a round boundary (or on join / catch-up): the trainer changes to map `m` (checked
  // against its fingerprint) when it differs from the one it trains under; a lost expert takes
  // its value from `published` (the round's model; null: the registry holds it already), the
  // compressed-upload base and residuals follow the new set, the frozen digest is taken again.
  // At a round boundary (`boundary`; not at a join) the moments of experts lost go to the
  // server first (hand_over_lost_moments).
  // Returns the sync record's "ownership" entry (null when nothing changed).
  nlohmann::json apply_ownership(Trainer& t, const OwnershipMap& m,
                                 const ParamRegistry* published = nullptr,
                                 bool boundary = false);
  // Keeps the step's loss and throughput (the trainer's metrics record) for the next heartbeat.
  void record_metrics(const nlohmann::json& record, int64_t step);

  NodeOptions opts_;
  Trainer* trainer_ = nullptr;
  std::unique_ptr<SyncClient> client_;
  std::unique_ptr<DeltaUpload> delta_;          // compressed uploads (disabled: compression none)
  int64_t held_round_ = -1;  // the published round whose model the node holds (digest checked)
  nlohmann::json join_record_;  // until a metrics line carries it: once per join
  int64_t tokens_at_sync_ = 0;
  std::string frozen_sha_;
  int64_t ownership_epoch_ = 0;  // the epoch of the map the node trains under (its uploads say it)
  std::atomic<int64_t> step_{0};
  std::mutex metrics_mu_;
  NodeMetrics metrics_;  // for the next heartbeat: last loss and throughput, losses since
  std::thread heartbeat_;
  std::mutex hb_mu_;
  std::condition_variable hb_cv_;
  bool hb_stop_ = false;
  uint32_t heartbeat_ms_ = 0;
  std::atomic<bool> stopping_{false};     // ends a round in flight early (destruction)
  std::unique_ptr<RoundInFlight> inflight_;  // with overlap: the round running in the background
  InFlightBuffers inflight_buffers_;          // with overlap: the last round's, for the next one
};

// The sync record's "handed_moments" entry after a change with `handed` moments (node_handoff.cpp):
// {"experts", "tensors", "sha256"}, the digest (round/moments_handoff.h moments_sha256) of the
// moments AdamW holds for those tensors now: equal to the departed owner's, bit for bit.
nlohmann::json handed_record(const Trainer& t, const ExpertMoments& handed);
// {experts, tensors, sha256 (moments_sha256), by_expert {"layer:expert": moments_sha256 of that
// expert}, exp_avg_sq_sum} of moments `m` (names of t's registry).
nlohmann::json moments_record(const Trainer& t, const ExpertMoments& m);

// SHA-256 over the names and fp32 bytes of the registry's frozen (non-trainable) tensors.
std::string frozen_weights_sha256(const ParamRegistry& registry);

}  // namespace spes::sync
