// Sync server state machine: the protocol's calls under one lock, and publication (see
// round_state.h).
#include "spes/sync/server/round_state.h"

#include "spes/sync/round/moments_handoff.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>
#include <set>

#include <fmt/ranges.h>

#include "spes/common/strings.h"
#include "spes/common/timing.h"
#include "spes/io/files.h"
#include "spes/model/memory_estimate.h"
#include "spes/sync/round/moments_handoff.h"
#include "spes/sync/round/ownership_map.h"
#include "spes/sync/round/reassign.h"
#include "spes/sync/round/round_clock.h"

namespace spes::sync {

namespace {
using Clock = std::chrono::steady_clock;
constexpr double kPublishRetryS = 5.0;  // a failed save of a closed round is retried this often

uint64_t random_u64() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
         static_cast<uint64_t>(Clock::now().time_since_epoch().count());
}

// The experts per layer the memory a joining node declares holds (-1: none declared), by the
// closed-form estimate of a node of this run at the node's precision (model/memory_estimate).
// Refused (InvalidArgument): a declaration that is not a finite number >= 0, one above
// spes_config.max_memory_capacity_gib, a precision that is not fp32 or amp_bf16.
int64_t memory_experts_of(const Config& cfg, const JoinInfo& info) {
  const double gib = info.memory_capacity_gib;
  const double cap = cfg.spes_config.elastic.max_memory_capacity_gib;
  const int64_t id = info.node.node_id;
  if (!std::isfinite(gib) || gib < 0)
    sync_fail(SyncErrc::InvalidArgument, "node {} declares spes_config.memory_capacity_gib {}: "
              "not a number >= 0 (the GiB it can train in; 0: not declared); set what the "
              "machine has", id, gib);
  if (gib > cap)
    sync_fail(SyncErrc::InvalidArgument, "node {} declares spes_config.memory_capacity_gib {}, "
              "more than this server believes (spes_config.max_memory_capacity_gib {}); set "
              "what the machine has, or raise the server's cap", id, gib, cap);
  if (gib == 0) return -1;
  Precision precision = cfg.precision.value();
  if (!info.precision.empty()) {
    if (info.precision != "fp32" && info.precision != "amp_bf16")
      sync_fail(SyncErrc::InvalidArgument, "node {} declares precision '{}'; expected fp32 or "
                "amp_bf16", id, printable(info.precision, 40));
    precision = info.precision == "fp32" ? Precision::Fp32 : Precision::AmpBf16;
  }
  const int64_t k = experts_within_memory(cfg, gib * 1073741824.0, precision);
  if (k < 0)
    spdlog::warn("node {} declares {} GiB, less than a node of this run needs without any "
                 "expert ({:.3f} GiB at {}): it takes no more experts", id, gib,
                 static_cast<double>(node_memory_training(cfg, 0, precision).total()) /
                     1073741824.0,
                 info.precision.empty() ? "the run's precision" : info.precision);
  else
    spdlog::info("node {} declares {} GiB: by the memory estimate at {} it can train {} "
                 "experts per layer", id, gib,
                 info.precision.empty() ? "the run's precision" : info.precision, k);
  return std::max<int64_t>(k, 0);
}

// A restarted server knows the departures saved with the round it resumes, not a departing
// Leave that came while the lost round was collected. A node hands its moments over only when
// it departs (just before that Leave), and the handover is kept in DIR/handoff/ across
// restarts: a node that handed over under the collecting round's epoch and still owns experts
// in it counts as departed again, so the round it departed in still introduces the next epoch
// (not reassign_after_rounds rounds later). A node that comes back joins as live again.
void depart_nodes_that_handed_over(Departures& departures, const HandedMoments& handed,
                                   const Ownership& collecting, int64_t epoch, int64_t round) {
  for (int64_t node = 0; node < collecting.num_nodes(); ++node) {
    if (departures.is_departed(node) || !std::filesystem::exists(handed.path(node, epoch)))
      continue;
    bool owns = false;
    for (int64_t l = 0; l < collecting.num_layers(); ++l)
      owns = owns || !collecting.experts_of(node, l).empty();
    if (!owns) continue;
    spdlog::info("sync server: node {} handed over its moments of ownership epoch {} before "
                 "the restart ('{}'): it left for good", node, epoch, handed.path(node, epoch));
    departures.left(node, true, round);
  }
}
}  // namespace

RoundState::RoundState(const Config& cfg, ServeOptions opts,
                       std::optional<InitialWeights> initial)
    : cfg_(cfg),
      opts_(std::move(opts)),
      incarnation_(random_u64()),
      model_(std::make_unique<SyncModel>(cfg_, std::move(initial))),
      members_(cfg_, *model_),
      store_(cfg_, opts_.out_dir, opts_.keep_uploads, *model_, incarnation_),
      epochs_(opts_.out_dir, model_->plan().ownership(), cfg_.spes_config.node_slots()),
      // Missed rounds declare a node departed only where that moves its experts (mode spes):
      // elsewhere an alive node that misses rounds is waited for, as before ownership epochs.
      departures_(static_cast<size_t>(cfg_.spes_config.node_slots()),
                  model_->plan().mode() == SyncMode::Spes
                      ? cfg_.spes_config.elastic.reassign_after_rounds : 0),
      handed_(opts_.out_dir),
      bounds_(cfg_, model_->plan(), model_->tensors()),
      experts_(cfg_, model_->plan(), model_->tensors()),
      history_(cfg_, model_->plan(), bounds_),
      uploads_(cfg_, *model_, bounds_, experts_, opts_.out_dir, opts_.keep_uploads, mu_,
               UploadEvents{[this] { round_.start_clock(); },
                            [this](int64_t node) {
                              departures_.upload_arrived(node, Clock::now());
                              round_.upload_accepted();
                              round_.fold_ready(uploads_);
                              maybe_publish(false);
                            },
                            [this](int64_t) { maybe_publish(false); },
                            [this] { cv_.notify_all(); }}),
      round_(cfg_, *model_) {
  const std::optional<PublishedRound> resumed =
      opts_.resume ? store_.resume() : std::optional<PublishedRound>();
  if (resumed) {
    published_ = *resumed;
    log_ = std::make_unique<RoundLog>(opts_.out_dir, true, published_.round,
                                      store_.saved_line());
  } else {
    log_ = std::make_unique<RoundLog>(opts_.out_dir, false, 0, nullptr);
    epochs_.start();  // before round 0 is persisted
    published_.sha256 = model_->weights_sha256();
    store_.persist(published_, nlohmann::json());
  }
  if (resumed && model_->plan().compression() != Compression::None)
    if (std::optional<DeltaRecord> d = store_.load_delta(published_)) delta_ = std::move(*d);
  if (resumed && model_->sparse() &&
      !model_->load_sparse_residual(store_.residual_path(), published_.round, published_.sha256))
    spdlog::warn("sync server: no residual of round {} in '{}' (missing, damaged or of another "
                 "round): the published change's residual restarts at zero", published_.round,
                 store_.residual_path());
  if (resumed) resume_ownership();
  if (resumed) restore_drift_state();
  if (resumed)
    depart_nodes_that_handed_over(departures_, handed_, model_->plan().ownership(),
                                  model_->plan().ownership_epoch(), published_.round + 1);
  uploads_.next_round(published_.round + 1);
  round_.begin(published_.round + 1);
  spdlog::info("sync server: mode {}, {} nodes, sync every {} steps, transfer {}, model {} "
               "({:.2f}M parameters), {} round {} sha256 {}; deadline {} s, quorum {}, {}",
               cfg_.spes_config.mode, members_.size(), cfg_.spes_config.sync_steps,
               cfg_.spes_config.transfer.dtype, model_->model_fingerprint(), [&] {
                 int64_t n = 0;
                 for (const auto& t : model_->tensors()) n += t.numel();
                 return n / 1e6;
               }(), resumed ? "resumed at" : "initial", published_.round,
               published_.sha256.substr(0, 16), cfg_.spes_config.timing.round_timeout,
               cfg_.spes_config.timing.min_nodes,
               cfg_.spes_config.transport.auth_tokens_file.empty() ? "no node tokens (loopback only)"
                                                         : "node tokens required");
}

RoundState::~RoundState() { close(); }

void RoundState::restore_drift_state() {
  const nlohmann::json saved = store_.load_drift_window(published_);
  if (!bounds_.restore(saved)) {
    bounds_.reset(model_->tensors());
    spdlog::warn("sync server: no usable drift window was saved with round {}; it starts over "
                 "from the resumed model", published_.round);
  }
  if (!history_.restore(saved.is_object() && saved.contains("history") ? saved["history"]
                                                                       : nlohmann::json())) {
    history_.reset();
    spdlog::warn("sync server: no usable history of accepted updates was saved with round {}; "
                 "it starts over (the first round after the restart is not compared with it)",
                 published_.round);
  }
  experts_.published(model_->tensors());
  if (!experts_.restore(saved.is_object() && saved.contains("experts") ? saved["experts"]
                                                                       : nlohmann::json())) {
    experts_.reset(model_->tensors());
    spdlog::warn("sync server: no usable per-expert drift state was saved with round {}; the "
                 "experts' norms in the resumed model count as their start and no expert is "
                 "flagged", published_.round);
  }
  if (!departures_.restore(saved.is_object() && saved.contains("departures")
                               ? saved["departures"] : nlohmann::json()))
    spdlog::warn("sync server: no record of missed rounds was saved with round {}; every "
                 "node's count of missed rounds starts at zero", published_.round);
}

nlohmann::json RoundState::drift_state() const {
  nlohmann::json j = bounds_.to_json();
  j["experts"] = experts_.to_json();
  j["history"] = history_.to_json();
  j["departures"] = departures_.to_json();
  return j;
}

std::set<ExpertKey> RoundState::merge_exclusions() const {
  // Flagged experts, and this round's experts of nodes whose upload was rejected.
  std::set<ExpertKey> out = experts_.flagged();
  for (const PlanTensor& t : model_->plan().tensors())
    if (t.role == ParamRole::Expert && t.owner >= 0 &&
        uploads_.state(static_cast<size_t>(t.owner)) == UploadStaging::State::Rejected)
      out.insert({t.layer, t.expert});
  return out;
}

int64_t RoundState::published_round() const {
  std::lock_guard<std::mutex> lk(mu_);
  return published_.round;
}

bool RoundState::all_left() const {
  std::lock_guard<std::mutex> lk(mu_);
  return all_left_locked();
}

bool RoundState::all_left_locked() const {
  for (size_t i = 0; i < members_.size(); ++i)
    if (takes_part(i) && member_end_locked(i) == MemberEnd::Active) return false;
  return true;
}

RoundState::MemberEnd RoundState::member_end_locked(size_t i) const {
  // A node declared departed (gone for good, its experts handed on) counts as left, unless it
  // came back and is training.
  const Member& m = members_[i];
  const bool departed = departures_.is_departed(static_cast<int64_t>(i)) &&
                        (!m.joined || m.left || members_.is_dead(i));
  if (m.left || departed) return MemberEnd::Left;
  // After the run's last round nothing is left to publish: a node killed then, or one that a
  // restarted server never sees again, would otherwise keep the server waiting forever.
  const bool run_over = published_.step >= cfg_.total_steps();
  if (!run_over) return MemberEnd::Active;
  const bool absent = !m.joined && seconds_since(published_at_) >
                                       cfg_.spes_config.timing.heartbeat_timeout;
  return members_.is_dead(i) || absent ? MemberEnd::Gone : MemberEnd::Active;
}

std::vector<int64_t> RoundState::gone_without_leaving() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<int64_t> out;
  for (size_t i = 0; i < members_.size(); ++i)
    if (takes_part(i) && member_end_locked(i) == MemberEnd::Gone)
      out.push_back(static_cast<int64_t>(i));
  return out;
}

JoinResult RoundState::join(const JoinInfo& info) {
  std::lock_guard<std::mutex> lk(mu_);
  const int64_t id = info.node.node_id;
  members_.check_id(info.node);
  check_join_ownership(info);
  const int64_t memory_experts = memory_experts_of(cfg_, info);  // checked before it counts
  if (members_.join(info)) uploads_.drop_kept(id, "the node restarted");
  departures_.joined(id, info.expert_capacity, memory_experts);
  spdlog::info("node {} joined (incarnation {:x}, step {}) at round {}", id,
               info.node.incarnation, info.step, published_.round);
  JoinResult r;
  r.server_incarnation = incarnation_;
  r.published_round = published_.round;
  r.published_step = published_.step;
  r.model_sha256 = published_.sha256;
  r.max_chunk_bytes = kMaxChunkBytes;
  r.heartbeat_interval_ms = members_.heartbeat_interval_ms();
  r.published_nodes = published_.nodes;
  r.ownership = collecting_map();
  return r;
}

uint64_t RoundState::upload_resume_offset(const NodeId& node, int64_t round, int64_t step,
                                          uint64_t total_bytes) {
  std::unique_lock<std::mutex> lk(mu_);
  members_.check(node);
  // The node's previous stream may still look open here (its end not processed yet).
  cv_.wait_for(lk, std::chrono::seconds(5), [&] {
    return uploads_.state(node.node_id) != UploadStaging::State::Uploading || closed_;
  });
  return uploads_.resume_offset(node, round, step, total_bytes);
}

std::unique_ptr<UploadSession> RoundState::begin_upload(const NodeId& node, int64_t round,
                                                        int64_t step, uint64_t total_bytes,
                                                        uint64_t offset) {
  std::unique_lock<std::mutex> lk(mu_);
  members_.check(node);
  if (closing_)
    sync_fail(SyncErrc::Unavailable, "node {}: round {} is closed and being saved ({}); send "
              "the upload again in a few seconds", node.node_id, published_.round + 1,
              closing_->error);
  if (round < 1)
    sync_fail(SyncErrc::InvalidArgument, "node {}: there is no round {} to upload (rounds "
              "start at 1)", node.node_id, round);
  if (round > published_.round + 1)  // also keeps round x sync_steps in range
    sync_fail(SyncErrc::FailedPrecondition, "node {}: upload for round {} refused: the server "
              "collects round {} (latest published {})", node.node_id, round,
              published_.round + 1, published_.round);
  const RoundClock clock(cfg_);
  if (step != clock.step_of(round))
    sync_fail(SyncErrc::InvalidArgument, "node {}: round {} is step {}, not {}", node.node_id,
              round, clock.step_of(round), step);
  members_.set_step(node.node_id, step);
  return uploads_.begin(lk, node, round, step, total_bytes, offset);
}

std::string RoundState::node_state(size_t i) const {
  if (!takes_part(i)) return "vacant";  // an arrival id that has not joined
  const Member& n = members_[i];
  if (departures_.is_departed(static_cast<int64_t>(i)) &&
      (n.left || !n.joined || members_.is_dead(i)))
    return "departed";
  if (n.left) return "left";
  if (!n.joined) return "not_joined";
  if (members_.is_dead(i)) return "dead";
  switch (uploads_.state(i)) {
    case UploadStaging::State::Uploading: return "uploading";
    case UploadStaging::State::Ready:
    case UploadStaging::State::Folded: return "uploaded";
    case UploadStaging::State::Rejected: return "rejected";
    case UploadStaging::State::None: break;
  }
  return "training";
}

nlohmann::json RoundState::missing_nodes() const {
  nlohmann::json out = nlohmann::json::array();
  for (size_t i = 0; i < members_.size(); ++i) {
    if (uploads_.arrived(i) || !takes_part(i)) continue;
    const Member& n = members_[i];
    std::string why = "timeout";
    if (uploads_.state(i) == UploadStaging::State::Rejected) why = "rejected: " +
                                                                   uploads_.rejection(i);
    else if (departures_.is_departed(static_cast<int64_t>(i))) why = "departed";
    else if (n.left) why = "left";
    else if (!n.joined) why = "not_joined";
    else if (members_.is_dead(i)) why = "dead";
    out.push_back({{"node", i}, {"reason", why}});
  }
  return out;
}

void RoundState::maybe_publish(bool deadline_check) {
  if (closed_) return;
  if (closing_) {
    // A closed round whose save failed: retried from the periodic tick, every few seconds.
    if (deadline_check && seconds_since(closing_->last_try) >= kPublishRetryS) publish();
    return;
  }
  // The nodes that take part: an arrival id that never joined (and owns nothing) holds no
  // round up.
  int64_t N = 0;
  for (size_t i = 0; i < members_.size(); ++i) N += takes_part(i) ? 1 : 0;
  auto decide = [&](int64_t& present) {
    present = 0;
    int64_t out = 0, refused = 0, waiting = 0;  // waiting: joined and alive, not uploaded yet
    for (int64_t i = 0; i < static_cast<int64_t>(members_.size()); ++i) {
      if (!takes_part(static_cast<size_t>(i))) continue;
      const bool rejected = uploads_.state(i) == UploadStaging::State::Rejected;
      if (uploads_.arrived(i)) ++present;
      else if (rejected || members_[i].left || members_.is_dead(i) || departures_.is_departed(i))
        ++out;
      else if (members_[i].joined)
        ++waiting;
      refused += rejected;
    }
    return round_.may_close(present, out, refused, waiting, N, deadline_check);
  };
  int64_t present = 0;
  OpenRound::Close close = decide(present);
  if (close == OpenRound::Close::No) return;
  // The uploads are all in: refuse the outliers among them, then decide again.
  if (screen_outliers()) close = decide(present);
  if (close == OpenRound::Close::No) return;
  if (present < N) round_.fold_rest(uploads_);
  const nlohmann::json missing = missing_nodes();
  if (!missing.empty())
    spdlog::warn("round {}: publishing with {} of {} nodes{}; missing {}", published_.round + 1,
                 present, N, close == OpenRound::Close::Deadline ? " at its deadline" : "",
                 missing.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  publish();
}

bool RoundState::screen_outliers() {
  // Against the round's other uploads, then (the rest) against the accepted updates of the
  // last rounds: the only check a round with a single upload has.
  const auto arrived = uploads_.arrived_updates();
  std::vector<UpdateBounds::Outlier> outliers = bounds_.outliers(arrived);
  for (UpdateBounds::Outlier& o : history_.outliers(arrived))
    if (std::none_of(outliers.begin(), outliers.end(),
                     [&](const UpdateBounds::Outlier& p) { return p.node == o.node; }))
      outliers.push_back(std::move(o));
  bool refold = false;
  for (const auto& o : outliers) {
    refold = refold || uploads_.state(o.node) == UploadStaging::State::Folded;
    uploads_.reject_arrived(o.node, fmt::format("upload of node {} round {}: {}", o.node,
                                                published_.round + 1, o.why));
  }
  if (refold) round_.refold(uploads_);
  return !outliers.empty();
}

bool RoundState::publish() {
  if (!closing_) close_round();
  if (!save_closed_round()) return false;
  advance_to_closed_round();
  return true;
}

void RoundState::close_round() {
  // The round's result is computed once, whatever happens to the save.
  const auto t0 = Clock::now();
  const nlohmann::json missing = missing_nodes();
  nlohmann::json node_states = nlohmann::json::array();
  for (size_t i = 0; i < members_.size(); ++i) node_states.push_back(node_state(i));
  std::set<ExpertKey> no_donors = merge_exclusions();
  std::vector<double> update_medians = history_.round_medians(uploads_.arrived_updates());
  uploads_.close_round();
  RoundOutcome o = round_.finish(std::move(no_donors));
  const bool compressed = model_->plan().compression() != Compression::None;
  std::unique_ptr<DeltaFileWriter> delta_file;
  const PublishedDelta delta = compressed ? quantise_publication_into(o, &delta_file)
                                          : PublishedDelta();
  const double aggregate_s = seconds_since(t0);
  closing_ = std::make_unique<Closing>();
  const auto t_delta = Clock::now();
  // With compression the digest is needed now (for the delta's record); otherwise persist
  // computes it while the model file is written.
  const std::string sha = compressed ? model_->weights_sha256() : std::string();
  if (delta_file) commit_delta_file(o, delta, sha, *delta_file, &closing_->record);
  // topk: the residual of this publication, saved before the round is (a restarted server
  // takes it back only when it belongs to the round it resumes).
  save_sparse_residual(o.round, sha);
  closing_->round = PublishedRound{o.round, o.step, sha, o.alpha, o.merged, o.nodes};
  closing_->change = o.change;
  closing_->update_medians = std::move(update_medians);
  closing_->closed_at = Clock::now();
  closing_->line = round_line(o, aggregate_s, missing, std::move(node_states));
  std::vector<bool> taking_part(members_.size());
  for (size_t i = 0; i < members_.size(); ++i) taking_part[i] = takes_part(i);
  departures_.round_published(o.round, o.nodes, o.tokens, closing_->closed_at, taking_part);
  decide_ownership(o.round, closing_->line);
  if (compressed) closing_->line["delta_write_s"] = seconds_since(t_delta);
}

void RoundState::save_sparse_residual(int64_t round, const std::string& sha) {
  if (!model_->sparse()) return;
  try {
    model_->save_sparse_residual(store_.residual_path(), round, sha);
  } catch (const std::exception& e) {
    // Costs a restarted server its residual (it restarts at zero), not the round.
    spdlog::error("round {}: cannot save the residual of the published change to '{}': {}",
                  round, store_.residual_path(), e.what());
  }
}

PublishedDelta RoundState::quantise_publication_into(RoundOutcome& o,
                                                    std::unique_ptr<DeltaFileWriter>* file) {
  // The published model is P_prev + deq(D), P_prev read back from the previous round's
  // published file, D written to the delta file as it is computed (published_delta.h); the
  // file is complete before the model is persisted.
  *file = store_.begin_delta(delta_layout(model_->plan(), o), o.round, published_.round);
  return quantise_publication(*model_, o, store_.published_path(), file->get());
}

void RoundState::commit_delta_file(const RoundOutcome& o, const PublishedDelta& delta,
                                   const std::string& sha, DeltaFileWriter& file,
                                   DeltaRecord* record) {
  // `record` stays invalid (nodes then get full tensors) when the file cannot be committed.
  const DeltaRecord r{o.round, published_.round, sha, published_.sha256, delta.tensors,
                      delta.owner_exact};
  if (store_.commit_delta(file, r)) *record = r;
}

nlohmann::json RoundState::round_line(const RoundOutcome& o, double aggregate_s,
                                      const nlohmann::json& missing,
                                      nlohmann::json node_states) const {
  const size_t N = members_.size();
  std::vector<uint64_t> bytes_in(N), wire_in(N), resumed_in(N);
  uint64_t total_in = 0;
  for (size_t i = 0; i < N; ++i) {
    const UploadStaging::Intake in = uploads_.intake(i);
    bytes_in[i] = in.bytes;
    total_in += in.bytes;
    wire_in[i] = in.wire_bytes;
    resumed_in[i] = in.resumed_bytes;
  }
  nlohmann::json line = {{"round", o.round},
                         {"step", o.step},
                         {"nodes", o.nodes},
                         {"tokens", o.tokens},
                         {"weights", o.weights},
                         {"bytes_in", total_in},
                         {"bytes_in_per_node", bytes_in},
                         {"bytes_in_wire_per_node", wire_in},
                         {"bytes_in_resumed_per_node", resumed_in},
                         {"alpha", o.alpha},
                         {"merged", o.merged},
                         {"gate_cos", o.gate_cos},
                         {"seconds", round_.seconds_open()},
                         {"aggregate_s", aggregate_s},
                         {"model_sha256", closing_->round.sha256},
                         {"node_states", std::move(node_states)},
                         {"missing", missing},
                         {"ownership_epoch", model_->plan().ownership_epoch()}};
  if (std::isfinite(o.outer_change_norm))
    line["outer"] = {{"momentum_cos", std::isfinite(o.outer_momentum_cos)
                                          ? nlohmann::json(o.outer_momentum_cos)
                                          : nlohmann::json()},
                     {"change_norm", o.outer_change_norm},
                     {"momentum_norm", o.outer_momentum_norm}};
  if (o.merged) line["gate_cos_before"] = o.gate_cos_before;
  if (o.merged && !o.merge_excluded.empty()) line["merge_excluded"] = o.merge_excluded;
  return line;
}

bool RoundState::save_closed_round() {
  // Saved before anyone can see the round: a crash now loses nothing, and a restarted server
  // continues from here (the line is kept in state.json for rounds.jsonl).
  Closing& c = *closing_;
  c.last_try = Clock::now();
  try {
    // A new ownership epoch is on disk before the round that introduces it (ownership_epochs.h).
    if (c.next_ownership) epochs_.introduce(*c.next_ownership, c.handoffs);
    c.round.sha256 = store_.persist(c.round, c.line);
    c.line["model_sha256"] = c.round.sha256;
    c.line["persist_s"] = seconds_since(c.last_try);
  } catch (const std::exception& e) {
    c.error = printable(e.what(), kMaxDetailBytes);
    spdlog::error("round {}: saving the published model failed, so the round is not published; "
                  "it is retried every {:.0f} s (free disk space in '{}'): {}", c.round.round,
                  kPublishRetryS, opts_.out_dir, c.error);
    return false;
  }
  if (!c.error.empty())
    spdlog::info("round {}: saved after an earlier failure ({})", c.round.round, c.error);
  return true;
}

void RoundState::advance_to_closed_round() {
  const std::unique_ptr<Closing> c = std::move(closing_);
  const PublishedRound& p = c->round;
  delta_ = std::move(c->record);  // invalid without compression
  published_ = p;
  published_at_ = Clock::now();
  if (c->next_ownership) {
    const OwnershipMap& m = *c->next_ownership;
    const RoundPlan& plan = model_->plan();
    model_->change_ownership(
        ownership_of(m, plan.num_nodes(), plan.ownership().num_layers(),
                     plan.ownership().num_experts(), "the server's next map"),
        m.epoch);
    spdlog::warn("round {}: ownership epoch {} (map {}) from round {} on: {} experts handed to "
                 "live nodes", p.round, m.epoch, m.fingerprint, m.from_round, c->handoffs.size());
  } else {
    model_->published_with_current_plan();
  }
  // What the next round's checks need of this model (its norms), before anyone sees it.
  bounds_.published(c->change, model_->tensors());
  experts_.published(model_->tensors());
  history_.published(std::move(c->update_medians));
  store_.save_drift_window(p, drift_state());
  uploads_.next_round(p.round + 1);
  // Unlinking four large files frees their blocks (slow on a disk mounted with discard): off
  // the publication's path.
  store_.defer(fmt::format("removing the staged uploads of round {}", p.round),
               [files = uploads_.staged_files(p.round)] {
                 std::error_code ec;
                 for (const auto& f : files) std::filesystem::remove(f, ec);
               });
  // Waiting nodes see the round once the lock is released, right after this.
  const auto published_at = Clock::now();
  nlohmann::json line = std::move(c->line);
  const double persist_s = line["persist_s"].get<double>();
  line["publish_s"] = round_.seconds_after_last_upload(published_at);
  log_->published(std::move(line), p.nodes, members_.size(), published_at);
  round_.begin(p.round + 1);
  spdlog::info("round {} (step {}) published: {} nodes, alpha {:.4g}, persist {:.2f} s, sha256 {}",
               p.round, p.step, p.nodes.size(), p.alpha, persist_s, p.sha256.substr(0, 16));
  cv_.notify_all();
}

void RoundState::wake_waiters() {
  std::lock_guard<std::mutex> lk(mu_);  // no wait may miss it between its check and its sleep
  cv_.notify_all();
}

RoundStatus RoundState::wait_round(const NodeId& node, int64_t round, uint32_t max_wait_ms,
                                   const std::function<bool()>& give_up) {
  std::unique_lock<std::mutex> lk(mu_);
  members_.check(node);
  const auto deadline =
      Clock::now() + std::chrono::milliseconds(std::min<uint32_t>(max_wait_ms, kMaxWaitMs));
  // Returns at once when the server does not hold (and is not receiving) the caller's upload
  // for the round it waits for: after a server restart, the node must send it again.
  cv_.wait_until(lk, deadline, [&] {
    return published_.round >= round || closed_ ||
           (round == published_.round + 1 &&
            uploads_.state(node.node_id) == UploadStaging::State::None) ||
           (give_up && give_up());
  });
  RoundStatus r;
  r.round = round;
  r.published_round = published_.round;
  r.step = RoundClock(cfg_).step_of(round);
  r.published = published_.round >= round;
  r.published_step = published_.step;
  if (r.published && round == published_.round) {
    r.model_sha256 = published_.sha256;
    r.alpha = published_.alpha;
    r.nodes = published_.nodes;
    // As for a node that holds the previous round (the usual case; the server does not know
    // what the node holds: RoundStatus::download_bytes says so).
    r.download_bytes =
        download_writer(node.node_id, round, Selection::ForNode, round - 1)->total_bytes();
  }
  r.ownership = collecting_map();
  if (!r.published && round == published_.round + 1)
    for (size_t i = 0; i < members_.size(); ++i)
      if (!uploads_.arrived(i) && takes_part(i)) r.waiting_for.push_back(static_cast<int64_t>(i));
  return r;
}

std::unique_ptr<SafetensorsStreamWriter> RoundState::download_writer(int64_t node, int64_t round,
                                                                     Selection selection,
                                                                     int64_t from_round) const {
  return sync::download_writer(model_->published_plan(), published_, store_.published_path(), node, round,
                               selection, DeltaSource{&delta_, store_.delta_path(), from_round});
}

std::unique_ptr<DownloadSession> RoundState::begin_download(const NodeId& node, int64_t round,
                                                            Selection selection,
                                                            uint64_t offset,
                                                            int64_t from_round) {
  std::lock_guard<std::mutex> lk(mu_);
  members_.check(node);
  if (round > published_.round)
    sync_fail(SyncErrc::FailedPrecondition, "node {}: round {} is not published yet (latest "
              "published round {})", node.node_id, round, published_.round);
  if (round < published_.round)
    sync_fail(SyncErrc::OutOfRange, "node {}: round {} is no longer available; the latest "
              "published round is {}: take that one", node.node_id, round, published_.round);
  auto writer = download_writer(node.node_id, round, selection, from_round);
  if (offset > writer->total_bytes())
    sync_fail(SyncErrc::OutOfRange, "node {}: download offset {} is past the end of round {}'s "
              "{} byte stream", node.node_id, offset, round, writer->total_bytes());
  const int64_t id = node.node_id;
  return std::make_unique<DownloadSession>(
      std::move(writer), round, offset,
      [this, id, round, selection](uint64_t bytes, uint64_t wire_bytes) {
        download_done(id, round, selection, bytes, wire_bytes);
      });
}

void RoundState::download_done(int64_t node, int64_t round, Selection selection,
                               uint64_t bytes, uint64_t wire_bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  if (selection == Selection::All || round == 0) {
    spdlog::info("node {} downloaded the whole model of round {} ({}, {} on the wire)", node,
                 round, human_bytes(static_cast<double>(bytes)),
                 human_bytes(static_cast<double>(wire_bytes)));
    return;
  }
  log_->downloaded(node, round, bytes, wire_bytes);
}

void RoundState::leave(const NodeId& node, int64_t step, const std::string& reason,
                       LeaveKind kind) {
  std::lock_guard<std::mutex> lk(mu_);
  members_.check(node);
  members_.leave(node.node_id, step);
  const bool departing = kind == LeaveKind::Departing;
  departures_.left(node.node_id, departing, published_.round + 1);
  spdlog::info("node {} left{} at step {}{}{}", node.node_id, departing ? " for good" : "", step,
               reason.empty() ? "" : ": ", printable(reason));
  maybe_publish(false);  // the round no longer waits for it
}

std::unique_ptr<MomentsIntake> RoundState::begin_hand_over(const NodeId& node,
                                                          uint64_t total_bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  members_.check(node);
  if (model_->plan().mode() != SyncMode::Spes)
    sync_fail(SyncErrc::FailedPrecondition, "node {}: moments are handed over with experts, in "
              "mode spes only", node.node_id);
  const std::optional<Ownership> previous = previous_ownership();
  return std::make_unique<MomentsIntake>(
      handed_.staging_path(node.node_id), total_bytes,
      max_moments_bytes(model_->plan(), node.node_id, previous ? &*previous : nullptr),
      node.node_id);
}

std::pair<int64_t, int64_t> RoundState::finish_hand_over(const NodeId& node,
                                                         MomentsIntake& intake) {
  std::unique_lock<std::mutex> lk(mu_);
  members_.check(node);
  const RoundPlan plan = model_->plan();  // a copy: the checks run without the lock
  const std::optional<Ownership> previous = previous_ownership();
  const nlohmann::json handoffs = epochs_.handoffs(plan.ownership_epoch());
  lk.unlock();
  bool lost = false;
  const auto experts =
      handed_.check(intake.path(), plan, node.node_id, previous ? &*previous : nullptr, &lost);
  if (lost) check_lost_to_arrivals(node.node_id, experts, handoffs);
  lk.lock();
  members_.check(node);
  if (model_->plan().ownership_epoch() != plan.ownership_epoch())
    sync_fail(SyncErrc::InvalidArgument, "node {}: ownership epoch {} began while its moments "
              "of epoch {} arrived: they are not kept", node.node_id,
              model_->plan().ownership_epoch(), plan.ownership_epoch());
  // A lost handover holds the moments of the epoch before (the file its experts' new owners
  // look up: the previous owner's newest below the epoch that moved them).
  const int64_t epoch = plan.ownership_epoch() - (lost ? 1 : 0);
  handed_.keep(intake, node.node_id, epoch);
  cv_.notify_all();  // a new owner's FetchMoments may wait for them
  spdlog::info("node {} handed over the AdamW moments of {} experts ({}ownership epoch {}, {} "
               "bytes): their next owners continue from them", node.node_id, experts.size(),
               lost ? "lost to an arrival, " : "", epoch, intake.bytes());
  return {static_cast<int64_t>(experts.size()), epoch};
}

NamedTensors RoundState::handed_moments(const NodeId& node, int64_t epoch) {
  std::unique_lock<std::mutex> lk(mu_);
  members_.check(node);
  if (epoch <= 0 || epoch > epochs_.latest().epoch)
    sync_fail(SyncErrc::InvalidArgument, "node {} asks for the moments of ownership epoch {}; "
              "this run's epochs with handoffs are 1..{}", node.node_id, epoch,
              epochs_.latest().epoch);
  const nlohmann::json handoffs = epochs_.handoffs(epoch);
  wait_for_lost_moments(lk, node.node_id, epoch, handoffs);
  lk.unlock();
  return handed_.for_node(node.node_id, epoch, handoffs);
}

std::optional<Ownership> RoundState::previous_ownership() const {
  const int64_t e = model_->plan().ownership_epoch();
  if (e <= 0) return std::nullopt;
  const OwnershipMap& m = epochs_.epoch(e - 1);
  return Ownership(m.num_nodes, m.table);
}

void RoundState::check_lost_to_arrivals(int64_t node,
                                        const std::vector<std::pair<int64_t, int64_t>>& experts,
                                        const nlohmann::json& handoffs) const {
  for (const auto& [l, e] : experts) {
    bool handed = false;
    for (const auto& h : handoffs)
      handed = handed || (h.at("layer").get<int64_t>() == l &&
                          h.at("expert").get<int64_t>() == e &&
                          h.at("from").get<int64_t>() == node && h.value("why", "") == kArrivalWhy);
    if (!handed)
      sync_fail(SyncErrc::InvalidArgument, "moments handover of node {}: expert {} of layer {} "
                "was not handed to an arrival in the current ownership epoch (it moved because "
                "its owner was declared departed, and its new owner started without moments): "
                "nothing is kept", node, e, l);
  }
}

void RoundState::wait_for_lost_moments(std::unique_lock<std::mutex>& lk, int64_t node,
                                       int64_t epoch, const nlohmann::json& handoffs) {
  // The experts an arrival takes come from live nodes, which hand their moments over right
  // after applying the epoch's map: wait for them as long as a round may wait for a node
  // (round_timeout: a donor on a slow link downloads that round and uploads the moments in
  // that time) unless their previous owner is no longer live.
  std::set<int64_t> from;
  for (const auto& h : handoffs)
    if (h.at("to").get<int64_t>() == node && h.value("why", "") == kArrivalWhy)
      from.insert(h.at("from").get<int64_t>());
  if (from.empty()) return;
  auto ready = [&] {
    const std::vector<int64_t> live = live_nodes();
    for (int64_t f : from)
      if (!file_exists(handed_.path(f, epoch - 1)) &&
          std::find(live.begin(), live.end(), f) != live.end())
        return false;
    return true;
  };
  const double wait_s = cfg_.spes_config.timing.round_timeout;
  const auto deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(wait_s * 1000));
  if (!cv_.wait_until(lk, deadline, [&] { return closed_ || ready(); }))
    spdlog::warn("node {}: the moments of the experts it takes in ownership epoch {} did not "
                 "all arrive from their previous owners [{}] within {:.0f} s: the missing ones "
                 "start at zero with the re-warm-up (spes_config.round_timeout)", node, epoch,
                 fmt::join(from, ", "), wait_s);
}

int64_t RoundState::heartbeat(const NodeId& node, int64_t step, const NodeMetrics& m) {
  std::lock_guard<std::mutex> lk(mu_);
  members_.check(node);
  members_.heartbeat(node.node_id, step, m);
  return published_.round;
}

std::vector<nlohmann::json> RoundState::round_history() const {
  std::lock_guard<std::mutex> lk(mu_);
  return log_->history();
}

std::vector<std::vector<LossPoint>> RoundState::loss_history() const {
  std::lock_guard<std::mutex> lk(mu_);
  return members_.loss_history();
}

ServerStatus RoundState::status() const {
  std::lock_guard<std::mutex> lk(mu_);
  ServerStatus st;
  st.published_round = published_.round;
  st.published_step = published_.step;
  st.collecting_round = published_.round + 1;
  st.model_sha256 = published_.sha256;
  st.round_open_s = round_.seconds_open();
  if (closing_) st.publish_error = closing_->error;
  st.ownership_epoch = model_->plan().ownership_epoch();
  for (const auto& [node, why] : departures_.departed()) st.departed.push_back(node);
  st.frozen_experts = frozen_experts();
  for (size_t i = 0; i < members_.size(); ++i) {
    const Member& m = members_[i];
    NodeState n;
    n.node_id = static_cast<int64_t>(i);
    n.state = node_state(i);
    n.step = m.step;
    n.last_seen_s = m.seen ? seconds_since(m.last_seen) : -1.0;
    n.detail = uploads_.rejection(i);
    n.loss = m.loss;
    n.tokens_per_s = m.tokens_per_s;
    st.nodes.push_back(n);
  }
  return st;
}

void RoundState::tick() {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return;
  cv_.notify_all();  // long-polls check whether their caller gave up
  try {
    members_.log_dead();
    maybe_publish(true);
  } catch (const std::exception& e) {
    // Nothing a node sent may stop the server: log it, keep serving, try again next tick.
    spdlog::error("sync server: periodic round check failed (retried): {}", printable(e.what()));
    return;
  }
  if (!round_.wait_log_due(opts_.wait_log_s)) return;
  std::vector<size_t> waiting;
  size_t taking_part = 0;
  for (size_t i = 0; i < members_.size(); ++i) {
    if (!takes_part(i)) continue;
    ++taking_part;
    if (!uploads_.arrived(i)) waiting.push_back(i);
  }
  spdlog::info("round {}: waiting for the upload of node(s) [{}] for {:.0f} s ({} of {} in)",
               published_.round + 1, fmt::join(waiting, ", "), round_.seconds_open(),
               taking_part - waiting.size(), taking_part);
}

void RoundState::close() {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return;
  closed_ = true;
  // The run ended: nobody can need the handed-over moments any more (a server stopped before
  // that keeps them for its restart).
  if (all_left_locked()) handed_.remove_all();
  log_->flush_pending();
  cv_.notify_all();
  store_.flush();  // the last round on disk before the server exits
}

OwnershipMap RoundState::ownership_at(int64_t round) const {
  std::lock_guard<std::mutex> lk(mu_);
  return epochs_.at_round(round);
}

const OwnershipMap& RoundState::collecting_map() const {
  return epochs_.at_round(published_.round + 1);
}

void RoundState::resume_ownership() {
  epochs_.resume(published_.round);
  const RoundPlan& plan = model_->plan();
  auto apply = [&](const OwnershipMap& m) {
    model_->change_ownership(ownership_of(m, plan.num_nodes(), plan.ownership().num_layers(),
                                          plan.ownership().num_experts(), epochs_.path()),
                             m.epoch);
  };
  const OwnershipMap& published = epochs_.at_round(published_.round);
  const OwnershipMap& collecting = collecting_map();
  if (published.epoch != 0) {
    apply(published);
    model_->published_with_current_plan();
  }
  if (collecting.epoch != published.epoch) apply(collecting);
}

void RoundState::check_join_ownership(const JoinInfo& info) const {
  const int64_t E = model_->plan().ownership().num_experts();
  if (info.expert_capacity < 0 || info.expert_capacity > E)
    sync_fail(SyncErrc::InvalidArgument, "node {} declares spes_config.expert_capacity {}, "
              "outside [0, moe_num_experts={}] (experts per layer it can train; 0: no cap); "
              "set a value the node can hold", info.node.node_id, info.expert_capacity, E);
  // The server's map wins: a node that holds an older epoch of this run changes to the
  // current one (JoinResult::ownership); one that holds an epoch this server never decided
  // (its directory lost ownership.json, or another run) is refused.
  if (epochs_.knows(info.ownership_epoch, info.ownership_fingerprint)) return;
  sync_fail(SyncErrc::FailedPrecondition, "node {} holds ownership epoch {} (map {}) but this "
            "server's epochs are 0 to {} ({} is map {}): the server's directory lost its "
            "ownership history or belongs to another run; restart the server on the run's "
            "directory, or start the node fresh (without its checkpoint)", info.node.node_id,
            info.ownership_epoch, printable(info.ownership_fingerprint, 40),
            epochs_.latest().epoch, epochs_.latest().epoch, epochs_.latest().fingerprint);
}

std::vector<int64_t> RoundState::live_nodes() const {
  std::vector<int64_t> out;
  for (size_t i = 0; i < members_.size(); ++i) {
    const Member& m = members_[i];
    const int64_t node = static_cast<int64_t>(i);
    if (m.joined && !m.left && !members_.is_dead(i) && !departures_.is_departed(node))
      out.push_back(node);
  }
  return out;
}

bool RoundState::takes_part(size_t i) const {
  if (static_cast<int64_t>(i) < cfg_.spes_config.num_peers || members_[i].joined) return true;
  const Ownership& o = model_->plan().ownership();  // an arrival that owns experts (a restart)
  for (int64_t l = 0; l < o.num_layers(); ++l)
    for (int64_t e = 0; e < o.num_experts(); ++e)
      if (o.owner(l, e) == static_cast<int64_t>(i)) return true;
  return false;
}

std::vector<std::string> RoundState::frozen_experts() const {
  std::vector<std::string> out;
  const Ownership& o = model_->plan().ownership();
  for (int64_t l = 0; l < o.num_layers(); ++l)
    for (int64_t e = 0; e < o.num_experts(); ++e)
      if (departures_.is_departed(o.owner(l, e))) out.push_back(fmt::format("{}:{}", l, e));
  return out;
}

void RoundState::log_frozen(int64_t round, const std::vector<std::pair<int64_t, int64_t>>& frozen_now,
                            nlohmann::json& line) {
  if (!frozen_now.empty()) {
    nlohmann::json frozen = nlohmann::json::array();
    for (const auto& [l, e] : frozen_now) frozen.push_back({l, e});
    line["frozen_experts"] = frozen;
    if (frozen_now != frozen_logged_)
      spdlog::warn("round {}: {} experts of departed nodes have no live node that can take them "
                   "(every live node is at its declared capacity or memory, or none is live): they stay "
                   "frozen at their last published value ([layer, expert]: {})", round,
                   frozen_now.size(), frozen.dump());
  }
  frozen_logged_ = frozen_now;
}

std::vector<int64_t> RoundState::arrivals(const std::vector<std::vector<int64_t>>& table) const {
  std::vector<int64_t> out;
  for (int64_t node : live_nodes()) {
    if (node < cfg_.spes_config.num_peers && !departures_.returned(node)) continue;
    bool owns = false;
    for (const auto& row : table)
      owns = owns || std::find(row.begin(), row.end(), node) != row.end();
    if (!owns) out.push_back(node);
  }
  return out;
}

void RoundState::decide_ownership(int64_t round, nlohmann::json& line) {
  const RoundPlan& plan = model_->plan();
  if (plan.mode() != SyncMode::Spes) return;
  const std::vector<LiveNode> live = departures_.live_nodes(live_nodes());
  Reassignment r;
  r.table = plan.ownership().table();
  if (cfg_.spes_config.elastic.reassign_after_rounds > 0 && !departures_.departed().empty()) {
    r = reassign_experts(plan.ownership(), departures_.departed(), live);
    log_frozen(round, r.frozen, line);
  }
  // Then the arrivals take experts from the most loaded live nodes (issue 38 item 6).
  const std::vector<int64_t> arriving = arrivals(r.table);
  if (!arriving.empty()) {
    Reassignment a = give_to_arrivals(r.table, arriving, live);
    r.table = std::move(a.table);
    for (const Handoff& h : a.handoffs) r.handoffs.push_back(h);
    if (a.handoffs.empty())
      spdlog::warn("round {}: node(s) [{}] arrived but no live node owns two experts of a "
                   "layer to give (a donor keeps one): they train the shared tensors only",
                   round, fmt::join(arriving, ", "));
  }
  if (!r.changed()) return;
  OwnershipMap next = ownership_map(Ownership(plan.num_nodes(), std::move(r.table)),
                                    plan.ownership_epoch() + 1, round + 1);
  nlohmann::json handoffs = nlohmann::json::array();
  for (const Handoff& h : r.handoffs)
    handoffs.push_back({{"layer", h.layer}, {"expert", h.expert}, {"from", h.from},
                        {"to", h.to}, {"why", h.why}, {"round", next.from_round}});
  line["ownership_next"] = {{"epoch", next.epoch}, {"from_round", next.from_round},
                            {"fingerprint", next.fingerprint}};
  line["handoffs"] = handoffs;
  closing_->handoffs = std::move(handoffs);
  closing_->next_ownership = std::move(next);
}

}  // namespace spes::sync
