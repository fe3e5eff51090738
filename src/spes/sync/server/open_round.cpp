// The round being collected: fold order, clock and closing rule (see open_round.h).
#include "spes/sync/server/open_round.h"

#include <algorithm>

#include "spes/common/timing.h"
#include "spes/sync/round/round_clock.h"

namespace spes::sync {

OpenRound::OpenRound(const Config& cfg, SyncModel& model)
    : cfg_(cfg), model_(model), agg_(model) {}

void OpenRound::begin(int64_t round) {
  round_ = round;
  next_fold_ = 0;
  started_ = false;
  last_accepted_.reset();
  agg_.begin(round, RoundClock(cfg_).step_of(round));
}

void OpenRound::start_clock() {
  if (started_) return;
  started_ = true;
  start_ = last_wait_log_ = std::chrono::steady_clock::now();
}

double OpenRound::seconds_open() const { return started_ ? seconds_since(start_) : 0.0; }

void OpenRound::upload_accepted() { last_accepted_ = std::chrono::steady_clock::now(); }

double OpenRound::seconds_after_last_upload(std::chrono::steady_clock::time_point t) const {
  return last_accepted_ ? std::chrono::duration<double>(t - *last_accepted_).count() : 0.0;
}

void OpenRound::fold_ready(UploadStaging& uploads) {
  const int64_t n = cfg_.spes_config.node_slots();
  while (next_fold_ < n && uploads.state(next_fold_) == UploadStaging::State::Ready) {
    fold_upload_file(agg_, model_.plan(), uploads.staged_file(next_fold_), next_fold_,
                     /*values_checked=*/true);
    uploads.mark_folded(next_fold_);
    ++next_fold_;
  }
}

void OpenRound::fold_rest(UploadStaging& uploads) {
  const int64_t n = cfg_.spes_config.node_slots();
  for (int64_t i = next_fold_; i < n; ++i) {
    if (uploads.state(i) != UploadStaging::State::Ready) continue;
    fold_upload_file(agg_, model_.plan(), uploads.staged_file(i), i, /*values_checked=*/true);
    uploads.mark_folded(i);
  }
  next_fold_ = n;
}

void OpenRound::refold(UploadStaging& uploads) {
  // The sum starts over in node order, as if the refused upload had never arrived: the uploads
  // up to the first node still missing are folded now, the rest when the round closes (or when
  // the missing ones arrive; a round whose every upload was refused closes unchanged when no
  // node is left to upload: may_close).
  agg_.abort();
  agg_.begin(round_, RoundClock(cfg_).step_of(round_));
  const int64_t n = cfg_.spes_config.node_slots();
  for (int64_t i = 0; i < n; ++i) uploads.mark_ready(static_cast<size_t>(i));
  next_fold_ = 0;
  while (next_fold_ < n && uploads.state(next_fold_) == UploadStaging::State::Rejected)
    ++next_fold_;
  fold_ready(uploads);
}

OpenRound::Close OpenRound::may_close(int64_t present, int64_t out, int64_t refused,
                                      int64_t waiting, int64_t num_nodes,
                                      bool deadline_check) const {
  const bool past_deadline = deadline_check && started_ &&
                             seconds_since(start_) >= cfg_.spes_config.timing.round_timeout;
  if (present == 0) {
    // Nothing to aggregate: only a round whose uploads were all refused, with nobody left to
    // upload, closes (unchanged); one that nobody uploaded to waits for its nodes.
    if (refused == 0 || waiting > 0) return Close::No;
    if (out == num_nodes) return Close::Everyone;
    return past_deadline ? Close::Deadline : Close::No;
  }
  const int64_t quorum = std::min(cfg_.spes_config.timing.min_nodes, present + waiting);
  if (present < quorum) return Close::No;
  if (present + out == num_nodes) return Close::Everyone;
  return past_deadline ? Close::Deadline : Close::No;
}

bool OpenRound::wait_log_due(double every_s) {
  if (!started_ || seconds_since(last_wait_log_) < every_s) return false;
  last_wait_log_ = std::chrono::steady_clock::now();
  return true;
}

}  // namespace spes::sync
