// The round being collected, on the aggregator: folds accepted uploads in ascending node order
// as soon as every lower node's upload is in (and the rest of them, skipping the missing nodes,
// when the round closes without some), its clock (from its first upload: the deadline
// spes_config.round_timeout and the periodic log of whom it waits for; the time of its last
// accepted upload, for rounds.jsonl publish_s), and the rule for when
// it closes: every node arrived (uploaded, or out: rejected, left, dead), or the deadline
// passed with at least spes_config.min_nodes uploads (the quorum, at most the nodes still in
// the round: uploaded, or joined, alive and not out). The default quorum, 2, keeps one node
// alone from deciding a round while another is joined and alive (a lone early uploader,
// docs/SECURITY.md); a one-node run, or a round whose other nodes are all out, still closes
// with one upload. A round without any usable upload closes only when uploads of it were
// refused and no node is left to upload (every node out, or the deadline passed with none
// waiting): it then publishes the model unchanged, so that the refused nodes catch up to it and
// go on, instead of waiting for a round that can never fill.
// Not thread-safe: RoundState's lock guards it. Leaves out: what publishing writes
// (RoundState, round_store.h).
#pragma once
#include <chrono>
#include <cstdint>
#include <optional>
#include <set>
#include <utility>

#include "spes/io/config.h"
#include "spes/sync/round/aggregate.h"
#include "spes/sync/server/upload_staging.h"

namespace spes::sync {

class OpenRound {
 public:
  OpenRound(const Config& cfg, SyncModel& model);
  // Starts collecting `round` (the clock stops until its first upload).
  void begin(int64_t round);
  void start_clock();  // the round's first upload began (no-op after the first)
  bool clock_started() const { return started_; }
  double seconds_open() const;  // 0 before its first upload
  void upload_accepted();  // an upload was accepted (checked and staged): its time is kept
  // Seconds from the last accepted upload to `t` (0 before any): the server's own part of the
  // round once every upload it uses is in.
  double seconds_after_last_upload(std::chrono::steady_clock::time_point t) const;

  // Folds the ready uploads that come next in node order.
  void fold_ready(UploadStaging& uploads);
  // Folds every ready upload, skipping the nodes that are missing (the round closes now).
  void fold_rest(UploadStaging& uploads);
  // Starts the sum over and folds every accepted upload again (one was refused after it was
  // folded): the result is as if the refused upload had never arrived.
  void refold(UploadStaging& uploads);

  enum class Close { No, Everyone, Deadline };
  // Whether the round closes with `present` uploads, `out` nodes out (`refused` of them because
  // their upload was refused) and `waiting` nodes joined, alive and yet to upload, of
  // `num_nodes`; `deadline_check`: the periodic tick, which also closes at the deadline.
  Close may_close(int64_t present, int64_t out, int64_t refused, int64_t waiting,
                  int64_t num_nodes, bool deadline_check) const;
  // Aggregates the folded uploads into the model's published tensors; merging takes from no
  // expert in `no_donors` (layer, expert).
  RoundOutcome finish(std::set<std::pair<int64_t, int64_t>> no_donors) {
    agg_.exclude_from_merging(std::move(no_donors));
    return agg_.finish();
  }
  // True (and the log timer restarts) when the "waiting for" log is due, every `every_s`.
  bool wait_log_due(double every_s);

 private:
  const Config& cfg_;
  SyncModel& model_;
  RoundAggregator agg_;
  int64_t round_ = 0;
  int64_t next_fold_ = 0;
  bool started_ = false;
  std::chrono::steady_clock::time_point start_, last_wait_log_;
  std::optional<std::chrono::steady_clock::time_point> last_accepted_;
};

}  // namespace spes::sync
