// The sync server's state machine, without any transport: one lock over the pieces that each
// keep one concern, and the calls the protocol makes on them. The pieces: who takes part
// (membership.h: joins, tokens, heartbeats, dead nodes), the uploads of the collecting round
// (upload_staging.h: streams, their checks, staging, resuming), the collecting round itself
// (open_round.h: fold order, deadline, quorum), the state on disk and the restart
// (round_store.h), rounds.jsonl and the recent history (round_log.h), and downloads of the
// published round (download_session.h). Here: publication (aggregate; with compression turn
// the aggregate into P_prev + deq(D) (round/published_delta.h), D written to the delta file as
// it is computed; persist; then wake the waiters), node states and status for `spes status`
// and the dashboard, and leaving.
// server.cpp maps gRPC calls onto it one to one; tests drive it directly.
//
// Publication is a transaction: the round's result is computed once, then saved (round_store);
// only a saved round is published (the round number advances, waiters wake). When saving
// fails (a full disk), the round stays closed but unpublished, uploads are refused as
// Unavailable, the error shows in status and logs, and tick() retries every few seconds.
// Every call contains its errors: input from a node can fail that call, never the server.
//
// Round r (r >= 1) is the sync at step r * sync_steps. Round 0 is the initial model. The
// server accepts uploads for round published+1 only. A round publishes when every node has
// arrived (uploaded, or is out: upload rejected, dead, left), or once spes_config.round_timeout
// has passed since its first upload with at least spes_config.min_nodes uploads.
#pragma once
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "spes/io/config.h"
#include "spes/model/initial_weights.h"
#include "spes/sync/round/aggregate.h"
#include "spes/sync/server/departures.h"
#include "spes/sync/server/download_session.h"
#include "spes/sync/server/expert_drift.h"
#include "spes/sync/server/handed_moments.h"
#include "spes/sync/server/loss_history.h"
#include "spes/sync/server/membership.h"
#include "spes/sync/server/open_round.h"
#include "spes/sync/server/ownership_epochs.h"
#include "spes/sync/server/round_log.h"
#include "spes/sync/server/round_store.h"
#include "spes/sync/server/update_bounds.h"
#include "spes/sync/server/update_history.h"
#include "spes/sync/server/upload_staging.h"
#include "spes/sync/wire/protocol.h"

namespace spes::sync {

struct ServeOptions {
  std::string out_dir;
  bool keep_uploads = false;   // DIR/rounds/<r>/node<i>.safetensors and published.safetensors
  double wait_log_s = 30;      // log the nodes a round waits for this often
  bool resume = true;          // continue from DIR's state.json + published.safetensors if any
};

class RoundState {
 public:
  // Builds the model from cfg (initial weights from cfg.seed, or `initial`: those of
  // model.init_checkpoint) and persists round 0 in DIR, or, with opts.resume and a valid
  // DIR/state.json, continues from DIR's last published round.
  RoundState(const Config& cfg, ServeOptions opts,
             std::optional<InitialWeights> initial = std::nullopt);
  ~RoundState();

  JoinResult join(const JoinInfo& info);
  // `offset` > 0 resumes an interrupted upload at that byte (at most what the server kept, see
  // upload_resume_offset); 0 starts the upload over.
  std::unique_ptr<UploadSession> begin_upload(const NodeId& node, int64_t round, int64_t step,
                                              uint64_t total_bytes, uint64_t offset = 0);
  // How many bytes of this upload the server kept from an interrupted stream of the same node
  // incarnation (0: none; send from the start). Waits up to a few seconds for a stream of the
  // node that is still open (the server may not have noticed the break yet) to end.
  uint64_t upload_resume_offset(const NodeId& node, int64_t round, int64_t step,
                                uint64_t total_bytes);
  // Waits until `round` is published, max_wait_ms pass (at most kMaxWaitMs) or `give_up`
  // returns true (checked whenever waiters are woken: wake_waiters(), and every tick()); then
  // answers with the round's state at that moment.
  RoundStatus wait_round(const NodeId& node, int64_t round, uint32_t max_wait_ms,
                         const std::function<bool()>& give_up = {});
  // Wakes every wait_round so that each checks its give_up (a newer long-poll of the node, a
  // cancelled call).
  void wake_waiters();
  // `from_round`: the published round the node holds exactly (-1: none); with compression a
  // ForNode download is then the round's delta when the server holds it (download_session.h).
  std::unique_ptr<DownloadSession> begin_download(const NodeId& node, int64_t round,
                                                  Selection selection, uint64_t offset = 0,
                                                  int64_t from_round = -1);
  // kind Departing: the node goes for good, its experts are handed to live nodes at the next
  // round boundary (with spes_config.reassign_after_rounds > 0).
  void leave(const NodeId& node, int64_t step, const std::string& reason,
             LeaveKind kind = LeaveKind::Finished);
  // Protocol 9, a departing node's AdamW moments (handed_moments.h): the intake of a stream
  // of `total_bytes` (the node joined; the size bounded by the experts it owns now), then its
  // checks against the collecting round's plan (the epoch the node owns them under) and its
  // place on disk. finish_hand_over returns {experts kept, their epoch}.
  std::unique_ptr<MomentsIntake> begin_hand_over(const NodeId& node, uint64_t total_bytes);
  std::pair<int64_t, int64_t> finish_hand_over(const NodeId& node, MomentsIntake& intake);
  // The moments handed over for the experts `node` gains in ownership epoch `epoch` (stream
  // tensors of round/moments_handoff.h; empty when their owners handed none over).
  NamedTensors handed_moments(const NodeId& node, int64_t epoch);
  // Records the node's step and metrics (its loss curve); returns the latest published round.
  int64_t heartbeat(const NodeId& node, int64_t step, const NodeMetrics& metrics = {});
  ServerStatus status() const;
  // The rounds.jsonl records of the latest published rounds (at most kRoundHistory, oldest
  // first; also those of an earlier run in DIR). A round whose line is not written yet (its
  // downloads are still running) has no bytes_out.
  std::vector<nlohmann::json> round_history() const;
  static constexpr size_t kRoundHistory = RoundLog::kHistory;
  // Each node's loss curve from its heartbeats (LossHistory: at most 2000 points per node).
  std::vector<std::vector<LossPoint>> loss_history() const;

  // Periodic housekeeping (about 5 times a second): publishes a round whose deadline passed
  // with a quorum present, marks silent nodes dead, logs the nodes an open round waits for,
  // wakes the waiters (so that a long-poll whose caller went away ends).
  void tick();
  // The run needs no more of the server: every node has left (or was declared departed and is
  // not back), or the run's last round (max_duration) is published and every node that did not
  // leave is dead or has not joined within heartbeat_timeout of that round's publication (or
  // of this server's start: a server restarted after the run ended).
  bool all_left() const;
  // The nodes all_left() counts as done although they never left (dead or absent after the
  // run's last round), for the server's last log line.
  std::vector<int64_t> gone_without_leaving() const;
  // Writes the lines of rounds whose downloads are incomplete and wakes every waiter.
  void close();
  int64_t published_round() const;
  const SyncModel& model() const { return *model_; }
  // The ownership map of round `round` (ownership_epochs.h).
  OwnershipMap ownership_at(int64_t round) const;

 private:
  // All with the lock held.
  void maybe_publish(bool deadline_check);
  // Refuses the accepted uploads that are outliers among the nodes' (update_bounds.h) and
  // refolds the rest when one was folded; true when any was refused.
  bool screen_outliers();
  // Closes the round (computes its result, once) and tries to save and publish it; false
  // when saving failed (the round then waits for the next try).
  bool publish();
  // publish()'s steps: the round's result into closing_ (with compression, the published
  // model as P_prev + deq(D), D in the round's delta file, and the file's record); its
  // rounds.jsonl line; the save; the publication (the next round's bounds, the cleanup, the
  // log, waking waiters).
  void close_round();
  // The drift window and the per-expert state (drift_window.json): restored when resuming,
  // saved after each publication; the experts merging must not take from this round.
  void restore_drift_state();
  nlohmann::json drift_state() const;
  std::set<ExpertKey> merge_exclusions() const;
  // topk: the model's residual of the published change to the round store (a failure is logged).
  void save_sparse_residual(int64_t round, const std::string& sha);
  PublishedDelta quantise_publication_into(RoundOutcome& o,
                                           std::unique_ptr<DeltaFileWriter>* file);
  void commit_delta_file(const RoundOutcome& o, const PublishedDelta& delta,
                         const std::string& sha, DeltaFileWriter& file, DeltaRecord* record);
  nlohmann::json round_line(const RoundOutcome& o, double aggregate_s,
                            const nlohmann::json& missing, nlohmann::json node_states) const;
  // Ownership epochs: the map of round published + 1 on the wire; resuming the plans; at a
  // round's close, whether departed nodes' experts go to live nodes from the next round
  // (sets closing_->next_ownership and the round line's handoffs); the nodes that count as
  // live for that; the experts no live node owns.
  const OwnershipMap& collecting_map() const;
  void resume_ownership();
  void decide_ownership(int64_t round, nlohmann::json& line);
  void log_frozen(int64_t round, const std::vector<std::pair<int64_t, int64_t>>& frozen,
                  nlohmann::json& line);
  // Live nodes that own no expert in `table` and arrived: an id from num_peers on, or a
  // departed id that came back (issue 38 item 6).
  std::vector<int64_t> arrivals(const std::vector<std::vector<int64_t>>& table) const;
  bool all_left_locked() const;
  // Whether node i still takes part (Active), left or departed (Left), or is dead or absent
  // after the run's last round (Gone).
  enum class MemberEnd { Active, Left, Gone };
  MemberEnd member_end_locked(size_t i) const;
  // Moments of experts lost to an arrival (protocol 10): the map of the epoch before the
  // collecting one (none at epoch 0); a "lost" handover must hold only experts the epoch's
  // handoffs gave to an arrival from that node; a new owner's fetch waits for them.
  std::optional<Ownership> previous_ownership() const;
  void check_lost_to_arrivals(int64_t node, const std::vector<std::pair<int64_t, int64_t>>& experts,
                              const nlohmann::json& handoffs) const;
  void wait_for_lost_moments(std::unique_lock<std::mutex>& lk, int64_t node, int64_t epoch,
                             const nlohmann::json& handoffs);
  std::vector<int64_t> live_nodes() const;
  // Whether node id i takes part in the run: an initial node, one that joined, or one the map
  // gives experts; a vacant arrival id (issue 38 item 6) counts in no round.
  bool takes_part(size_t i) const;
  std::vector<std::string> frozen_experts() const;
  void check_join_ownership(const JoinInfo& info) const;
  bool save_closed_round();
  void advance_to_closed_round();
  std::string node_state(size_t i) const;
  nlohmann::json missing_nodes() const;  // who the collecting round lacks, and why
  std::unique_ptr<SafetensorsStreamWriter> download_writer(int64_t node, int64_t round,
                                                           Selection selection,
                                                           int64_t from_round) const;
  void download_done(int64_t node, int64_t round, Selection sel, uint64_t bytes,
                     uint64_t wire_bytes);  // takes it

  Config cfg_;
  ServeOptions opts_;
  uint64_t incarnation_;
  std::unique_ptr<SyncModel> model_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  Membership members_;
  RoundStore store_;
  OwnershipEpochs epochs_;
  Departures departures_;
  HandedMoments handed_;  // moments departing nodes handed over (DIR/handoff)
  UpdateBounds bounds_;
  ExpertDrift experts_;  // the run-long bound per expert (expert_drift.h)
  UpdateHistory history_;  // shared updates against the accepted ones (update_history.h)
  UploadStaging uploads_;
  OpenRound round_;
  std::unique_ptr<RoundLog> log_;
  PublishedRound published_;
  std::chrono::steady_clock::time_point published_at_ = std::chrono::steady_clock::now();
  DeltaRecord delta_;  // compression: the delta file of published_ (invalid: none held)
  // A closed round whose save failed: its result, waiting to be saved and published.
  struct Closing {
    PublishedRound round;
    nlohmann::json line;
    std::vector<double> change;
    std::vector<double> update_medians;  // the accepted updates, for history_
    DeltaRecord record;  // compression: the round's delta file, already in place
    std::optional<OwnershipMap> next_ownership;  // a new epoch from the next round on
    nlohmann::json handoffs;                      // what moved to make it
    std::chrono::steady_clock::time_point closed_at, last_try;
    std::string error;
  };
  std::unique_ptr<Closing> closing_;
  bool closed_ = false;
  std::vector<std::pair<int64_t, int64_t>> frozen_logged_;  // the frozen experts last logged
};

}  // namespace spes::sync
