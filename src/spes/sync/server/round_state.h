// The sync server's state machine, without any transport: joins (token and fingerprint
// checks), upload sessions (chunk checksums, header, value and update-size checks while the
// bytes arrive, staging on disk), folding staged uploads into the round in ascending node
// order, publication (aggregate, merge, persist atomically, wake the waiters), download
// sessions served from the persisted file (resumable from an offset), heartbeats and node
// states (with each node's last loss and throughput and a bounded loss curve), rounds.jsonl and
// the recent round history, leaving, and resuming from DIR after a restart.
// server.cpp maps gRPC calls onto it one to one; tests drive it directly.
//
// Round r (r >= 1) is the sync at step r * sync_steps. Round 0 is the initial model. The
// server accepts uploads for round published+1 only. A round publishes when every node has
// arrived (uploaded, or is out: upload rejected, dead, left), or once spes_config.round_timeout
// has passed since its first upload with at least spes_config.min_nodes uploads.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "spes/io/config.h"
#include "spes/sync/round/aggregate.h"
#include "spes/sync/server/loss_history.h"
#include "spes/sync/wire/protocol.h"

namespace spes::sync {

struct ServeOptions {
  std::string out_dir;
  bool keep_uploads = false;   // DIR/rounds/<r>/node<i>.safetensors and published.safetensors
  double wait_log_s = 30;      // log the nodes a round waits for this often
  bool resume = true;          // continue from DIR's state.json + published.safetensors if any
};

class RoundState;

// One upload stream. Destroying an unfinished session keeps the verified bytes it received
// (staged file, parser state, running digest) for a resumed stream of the same node
// incarnation and round, unless the upload was rejected or superseded; the kept bytes are
// dropped when the round publishes, the node joins with a new incarnation, or a new stream of
// the node starts from offset 0.
class UploadSession {
 public:
  ~UploadSession();
  // A chunk wholly before the bytes received so far is a repeat and ignored; one overlapping
  // their end contributes only its new bytes.
  void chunk(uint64_t offset, const std::string& data, const std::string& sha256_hex);
  // `expected_sha256`: the sender's hex SHA-256 of the whole stream (empty: not sent; required
  // for a resumed upload, whose staged bytes are then also re-read and hashed).
  UploadResult finish(const std::string& expected_sha256 = "");

 private:
  friend class RoundState;
  struct Impl;
  explicit UploadSession(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// One download stream of a published round.
class DownloadSession {
 public:
  ~DownloadSession();
  uint64_t total_bytes() const;
  int64_t round() const;
  // The next chunk (at most kChunkBytes); false once everything was sent. Throws
  // SyncError(Aborted) if a newer round was published meanwhile.
  bool next(std::string* data, uint64_t* offset);

 private:
  friend class RoundState;
  struct Impl;
  explicit DownloadSession(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class RoundState {
 public:
  // Builds the model from cfg (initial weights from cfg.seed) and persists round 0 in DIR, or,
  // with opts.resume and a valid DIR/state.json, continues from DIR's last published round.
  RoundState(const Config& cfg, ServeOptions opts);
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
  RoundStatus wait_round(const NodeId& node, int64_t round, uint32_t max_wait_ms);
  std::unique_ptr<DownloadSession> begin_download(const NodeId& node, int64_t round,
                                                  Selection selection, uint64_t offset = 0);
  void leave(const NodeId& node, int64_t step, const std::string& reason);
  // Records the node's step and metrics (its loss curve); returns the latest published round.
  int64_t heartbeat(const NodeId& node, int64_t step, const NodeMetrics& metrics = {});
  ServerStatus status() const;
  // The rounds.jsonl records of the latest published rounds (at most kRoundHistory, oldest
  // first; also those of an earlier run in DIR). A round whose line is not written yet (its
  // downloads are still running) has no bytes_out.
  std::vector<nlohmann::json> round_history() const;
  static constexpr size_t kRoundHistory = 1000;
  // Each node's loss curve from its heartbeats (LossHistory: at most 2000 points per node).
  std::vector<std::vector<LossPoint>> loss_history() const;

  // Periodic housekeeping (about 5 times a second): publishes a round whose deadline passed
  // with a quorum present, marks silent nodes dead, logs the nodes an open round waits for.
  void tick();
  bool all_left() const;
  // Writes the lines of rounds whose downloads are incomplete and wakes every waiter.
  void close();
  int64_t published_round() const;
  const SyncModel& model() const { return *model_; }

 private:
  friend class UploadSession;
  friend class DownloadSession;
  struct NodeSlot;
  struct PendingLine;
  void check_token(const NodeId& node) const;  // lock held
  void check_node(const NodeId& node);         // lock held; also marks the node seen
  void upload_done(int64_t node, int64_t round, const UploadMeta& meta, const std::string& path,
                   uint64_t bytes);              // lock held
  void reject_upload(int64_t node, int64_t round, uint64_t session, const std::string& why);
  void drop_kept_upload(NodeSlot& slot, const char* why);  // lock held
  void fold_ready();                             // lock held
  void maybe_publish(bool deadline_check);       // lock held
  void publish();                                // lock held
  void persist(const std::string& sha, const nlohmann::json& line);  // lock held
  bool resume_from_dir();                        // constructor
  bool is_dead(size_t i) const;                  // lock held
  std::string node_state(size_t i) const;        // lock held
  nlohmann::json missing_nodes() const;          // lock held: who the collecting round lacks
  void download_done(int64_t node, int64_t round, Selection sel, uint64_t bytes);
  void write_line(PendingLine& line);            // lock held
  void remember_round(const nlohmann::json& line);  // lock held: round_history
  std::unique_ptr<SafetensorsStreamWriter> download_writer(int64_t node, int64_t round,
                                                           Selection selection) const;  // lock held
  std::string published_path() const { return opts_.out_dir + "/published.safetensors"; }
  std::string staged_path(int64_t round, int64_t node) const;

  Config cfg_;
  ServeOptions opts_;
  std::unique_ptr<SyncModel> model_;
  std::unique_ptr<RoundAggregator> agg_;
  uint64_t incarnation_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<NodeSlot> nodes_;
  int64_t published_round_ = 0, published_step_ = 0;
  std::string published_sha_;
  double published_alpha_ = 0;
  bool published_merged_ = false;
  std::vector<int64_t> published_nodes_;
  std::vector<std::string> tokens_;  // per node; empty: no authentication
  uint64_t next_session_ = 1;
  uint64_t generation_ = 0;
  int64_t next_fold_ = 0;
  bool closed_ = false;
  std::chrono::steady_clock::time_point round_start_, last_wait_log_;
  bool round_started_ = false;
  std::vector<PendingLine> pending_;
  std::deque<nlohmann::json> history_;  // round_history()
  std::FILE* rounds_log_ = nullptr;
};

}  // namespace spes::sync
