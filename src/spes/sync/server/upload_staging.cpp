// Uploads of the collecting round: streams, their checks and their staging (see
// upload_staging.h).
#include "spes/sync/server/upload_staging.h"

#include <spdlog/spdlog.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "spes/common/strings.h"
#include "spes/io/files.h"
#include "spes/io/run_layout.h"
#include "spes/sync/round/change_kernels.h"
#include "spes/sync/server/upload_assembly.h"
#include "spes/sync/wire/checksum.h"
#include "spes/sync/wire/chunk_coding.h"
#include "spes/sync/wire/delta_codec.h"
#include "spes/sync/wire/framing.h"

namespace spes::sync {
namespace fs = std::filesystem;

namespace {
// ||run - pub||^2 in double, in one pass over the arriving values without temporaries or
// torch kernels: several uploads arrive at once, each on its own thread (a torch kernel there
// would start a thread team per upload), and this pass is also the check for NaN and Inf.
double squared_distance(const torch::Tensor& run, const torch::Tensor& pub) {
  const float* pp = pub.data_ptr<float>();
  const int64_t n = run.numel();
  if (run.is_contiguous()) {
    switch (run.scalar_type()) {
      case torch::kFloat32: return squared_change(run.data_ptr<float>(), pp, n);
      case torch::kBFloat16: return squared_change(run.data_ptr<c10::BFloat16>(), pp, n);
      case torch::kFloat16: return squared_change(run.data_ptr<c10::Half>(), pp, n);
      default: break;
    }
  }
  const torch::Tensor u = run.to(torch::kFloat32).contiguous();
  return squared_change(u.data_ptr<float>(), pp, n);
}

// ||run||^2 in double (finite: squared_distance checked the run first).
double squared_norm(const torch::Tensor& run) {
  const torch::Tensor u = run.to(torch::kFloat32).contiguous();
  const float* p = u.data_ptr<float>();
  double s = 0;
  for (int64_t k = 0, n = u.numel(); k < n; ++k) s += static_cast<double>(p[k]) * p[k];
  return s;
}
}  // namespace

// One upload's state; kept in its node's slot while a broken stream waits for a resume.
struct UploadStream {
  int64_t node = 0, round = 0, step = 0;
  uint64_t total = 0, session = 0, incarnation = 0;
  uint64_t wire = 0;  // chunk bytes this stream received (repeats included), not yet counted
  uint64_t resumed_from = 0;  // bytes kept from an interrupted stream when this one resumed it
  bool duplicate = false, stale = false, finished = false;
  bool broken = false;        // the staged bytes may not match `received`: never resume this
  std::string path, partial;
  std::string raw;  // the last coded chunk, decoded (reused)
  std::FILE* f = nullptr;
  std::unique_ptr<SafetensorsStreamReader> reader;
  std::unique_ptr<DeltaStreamDecoder> decoder;  // compressed uploads -> rebuilt fp32 runs
  UploadMeta meta;
  std::unique_ptr<UploadAssembly> assembly;  // chunk checks, bytes received, whole digest
  double diff_sq = 0;  // ||upload - published||^2
  std::vector<double> tensor_diff_sq;  // the same per model tensor
  std::vector<double> tensor_norm_sq;  // ||upload_t||^2 of the expert tensors (expert_drift.h)

  ~UploadStream() { close_file(); }
  void close_file() {
    if (f) std::fclose(f);
    f = nullptr;
  }
  // Closes and deletes this stream's staged bytes.
  void discard() {
    close_file();
    if (partial.empty()) return;
    std::error_code ec;
    fs::remove(partial, ec);
  }
};

// ---------------------------------------------------------------------------------------------
UploadSession::UploadSession(UploadStaging& staging, std::unique_ptr<UploadStream> stream)
    : staging_(staging), stream_(std::move(stream)) {}

UploadSession::~UploadSession() {
  if (stream_ && !stream_->finished) staging_.end(std::move(stream_));
}

void UploadSession::chunk(uint64_t offset, const std::string& data, const std::string& checksum,
                          uint32_t encoding) {
  staging_.chunk(*stream_, offset, data, checksum, encoding);
}

UploadResult UploadSession::finish(const std::string& expected_checksum) {
  return staging_.finish(*stream_, expected_checksum);
}

// ---------------------------------------------------------------------------------------------
UploadStaging::UploadStaging(const Config& cfg, const SyncModel& model,
                             const UpdateBounds& bounds, ExpertDrift& experts, std::string dir,
                             bool keep_uploads, std::mutex& mu, UploadEvents events)
    : cfg_(cfg), model_(model), bounds_(bounds), experts_(experts), dir_(std::move(dir)),
      keep_uploads_(keep_uploads), mu_(mu),
      events_(std::move(events)), slots_(cfg.spes_config.node_slots()) {
  fs::remove_all(run_layout::staging(dir_));
  fs::create_directories(run_layout::staging(dir_));
}

UploadStaging::~UploadStaging() = default;

std::string UploadStaging::staged_path(int64_t round, int64_t node) const {
  if (keep_uploads_)
    return run_layout::kept_upload(dir_, round, node);
  return run_layout::staged_upload(dir_, round, node);
}

UploadStaging::Intake UploadStaging::intake(size_t node) const {
  const Slot& s = slots_[node];
  return {s.bytes_in, s.wire_bytes, s.resumed_bytes};
}

void UploadStaging::drop_kept(int64_t node, const char* why) {
  Slot& slot = slots_[node];
  if (!slot.kept) return;
  UploadStream& k = *slot.kept;
  spdlog::info("round {}: dropping the {} bytes kept of node {}'s interrupted upload ({})",
               k.round, k.assembly->received(), k.node, why);
  k.discard();
  slot.kept.reset();
}

void UploadStaging::next_round(int64_t round) {
  collecting_ = round;
  round_closed_ = false;
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    s.state = State::None;
    s.bytes_in = s.wire_bytes = s.resumed_bytes = 0;
    drop_kept(static_cast<int64_t>(i), "the round was published");
    s.detail.clear();
  }
}

std::vector<std::string> UploadStaging::staged_files(int64_t round) const {
  std::vector<std::string> out;
  if (keep_uploads_) return out;
  for (size_t i = 0; i < slots_.size(); ++i)
    out.push_back(staged_path(round, static_cast<int64_t>(i)));
  return out;
}

uint64_t UploadStaging::resume_offset(const NodeId& node, int64_t round, int64_t step,
                                      uint64_t total_bytes) const {
  const UploadStream* k = slots_[node.node_id].kept.get();
  if (!k || k->incarnation != node.incarnation || k->round != round || k->step != step ||
      k->total != total_bytes || round != collecting_)
    return 0;
  return k->assembly->received();
}

void UploadStaging::reject(Slot& slot, int64_t node, int64_t round, const std::string& why) {
  slot.state = State::Rejected;
  slot.detail = printable(why, kMaxDetailBytes);  // shown in status, rounds.jsonl and replies
  spdlog::warn("round {}: upload of node {} rejected, the node is out of this round: {}", round,
               node, why);
  events_.out(node);
}

std::vector<std::pair<int64_t, const std::vector<double>*>> UploadStaging::arrived_updates()
    const {
  std::vector<std::pair<int64_t, const std::vector<double>*>> out;
  for (size_t i = 0; i < slots_.size(); ++i)
    if (arrived(i)) out.emplace_back(static_cast<int64_t>(i), &slots_[i].diff_sq);
  return out;
}

void UploadStaging::reject_arrived(size_t node, const std::string& why) {
  Slot& slot = slots_[node];
  slot.state = State::Rejected;
  slot.detail = printable(why, kMaxDetailBytes);
  spdlog::warn("round {}: upload of node {} rejected when the round closed, the node is out of "
               "this round: {}", collecting_, node, slot.detail);
  // Its file never counts: kept aside as NAME.rejected with keep_uploads (so that `spes
  // aggregate` over DIR/rounds/<r>/*.safetensors redoes the published round), else deleted.
  std::error_code ec;
  if (keep_uploads_) fs::rename(slot.path, slot.path + ".rejected", ec);
  else fs::remove(slot.path, ec);
}

void UploadStaging::reject_stream(const UploadStream& s, const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  Slot& slot = slots_[s.node];
  if (s.round != collecting_ || slot.session != s.session || slot.state != State::Uploading)
    return;
  reject(slot, s.node, s.round, why);
}

std::unique_ptr<UploadSession> UploadStaging::begin(std::unique_lock<std::mutex>& lk,
                                                    const NodeId& node, int64_t round,
                                                    int64_t step, uint64_t total_bytes,
                                                    uint64_t offset) {
  auto s = std::make_unique<UploadStream>();
  s->node = node.node_id;
  s->round = round;
  s->step = step;
  s->total = total_bytes;
  s->incarnation = node.incarnation;
  s->assembly = std::make_unique<UploadAssembly>(
      total_bytes, fmt::format("node {} round {}", node.node_id, round));
  if (offset > 0) return resume_kept(node, round, step, total_bytes, offset);
  admit_new_stream(*s);
  // From here on the session's destructor cleans up (file, slot) whatever goes wrong.
  UploadStream& stream = *s;
  auto session = std::make_unique<UploadSession>(*this, std::move(s));
  lk.unlock();
  if (!stream.duplicate) open_staged_file(stream);
  return session;
}

std::unique_ptr<UploadSession> UploadStaging::resume_kept(const NodeId& node, int64_t round,
                                                          int64_t step, uint64_t total_bytes,
                                                          uint64_t offset) {
  // A resume must continue the upload kept from this incarnation's interrupted stream.
  Slot& slot = slots_[node.node_id];
  const UploadStream* k = slot.kept.get();
  const bool same = k && k->incarnation == node.incarnation && k->round == round &&
                    k->step == step && k->total == total_bytes;
  const uint64_t held = same ? k->assembly->received() : 0;
  if (!same || offset > held || slot.accepted_round == round || slot.state != State::None)
    sync_fail(SyncErrc::DataLoss, "node {}: cannot resume the round {} upload at offset {}: the "
              "server holds {} bytes of it; ask where to resume again (resume_query) or send it "
              "from offset 0", node.node_id, round, offset, held);
  std::unique_ptr<UploadStream> s = std::move(slot.kept);
  s->resumed_from = s->assembly->received();
  slot.resumed_bytes += s->resumed_from;
  slot.state = State::Uploading;
  slot.session = s->session = next_session_++;
  spdlog::info("round {}: node {} resumes its upload at byte {} of {} (sends from {})", round,
               node.node_id, s->resumed_from, total_bytes, offset);
  return std::make_unique<UploadSession>(*this, std::move(s));
}

void UploadStaging::admit_new_stream(UploadStream& s) {
  Slot& slot = slots_[s.node];
  if (slot.accepted_round == s.round) {
    // Already accepted: a retry whose reply was lost (same incarnation: nothing to do), or
    // a restarted node sending the round again (its first upload counts; it must take the
    // published model). Either way it is never applied twice.
    s.duplicate = true;
    s.stale = slot.accepted_incarnation != s.incarnation;
  } else if (s.round < collecting_) {
    sync_fail(SyncErrc::OutOfRange, "node {}: round {} is closed (latest published round {}); "
              "an old round's upload is never applied: take the published model and carry on",
              s.node, s.round, collecting_ - 1);
  } else if (s.round != collecting_) {
    sync_fail(SyncErrc::FailedPrecondition, "node {}: upload for round {} refused: the server "
              "collects round {} (latest published {})", s.node, s.round, collecting_,
              collecting_ - 1);
  } else if (round_closed_) {
    sync_fail(SyncErrc::Unavailable, "node {}: round {} is closed and being published; send the "
              "upload again in a few seconds", s.node, s.round);
  } else if (slot.state == State::Rejected) {
    sync_fail(SyncErrc::InvalidArgument, "node {}: its upload for round {} was rejected ({}); "
              "it is out of this round: take the published model when the round publishes",
              s.node, s.round, slot.detail);
  } else if (slot.state == State::Ready || slot.state == State::Folded) {
    s.duplicate = true;
    s.stale = slot.accepted_incarnation != s.incarnation;
  } else {
    check_upload_size(slot, s);
    // An upload still open for this node (a dead connection, a restarted node) is
    // superseded: its finish() will be refused. A kept interrupted one is dropped.
    drop_kept(s.node, "the node sends its upload again from the start");
    slot.state = State::Uploading;
    slot.session = s.session = next_session_++;
    events_.started();
  }
}

void UploadStaging::check_upload_size(Slot& slot, const UploadStream& s) {
  const uint64_t limit = 8 + model_.plan().max_upload_header_bytes(s.node) +
                         model_.plan().upload_data_bytes(s.node);
  if (s.total >= 8 && s.total <= limit) return;
  const std::string why = fmt::format("node {}: an upload of {} bytes is impossible (its tensors "
                                      "take at most {} bytes)", s.node, s.total, limit);
  reject(slot, s.node, s.round, why);
  throw SyncError(SyncErrc::ResourceExhausted, why);
}

void UploadStaging::open_staged_file(UploadStream& s) {
  s.path = staged_path(s.round, s.node);
  // One file per stream: a superseded stream still open never shares (or deletes) it.
  s.partial = fmt::format("{}.partial{}", s.path, s.session);
  fs::create_directories(fs::path(s.path).parent_path());
  s.f = std::fopen(s.partial.c_str(), "wb");
  if (!s.f) sync_fail(SyncErrc::Internal, "cannot create '{}'", s.partial);
  const std::string origin = fmt::format("upload of node {} round {}", s.node, s.round);
  UploadStream* sp = &s;
  s.reader = std::make_unique<SafetensorsStreamReader>(
      s.total, origin,
      [this, sp, origin](const StreamHeader& h) {
        sp->meta = check_upload_header(model_.plan(), h, sp->node, origin);
        if (sp->meta.round != sp->round || sp->meta.step != sp->step)
          sync_fail(SyncErrc::InvalidArgument, "{}: payload says round {} step {}", origin,
                    sp->meta.round, sp->meta.step);
        check_upload_tokens(cfg_, sp->meta, origin);
      },
      nullptr, model_.plan().max_upload_header_bytes(s.node));
  s.tensor_diff_sq.assign(model_.tensors().size(), 0.0);
  s.tensor_norm_sq.assign(model_.tensors().size(), 0.0);
  // Values are checked piece by piece as they arrive (memory: one chunk per upload), and
  // their distance from the published model is accumulated for the update-size bound. A
  // compressed upload is first rebuilt (P_prev + deq(q)), so every check sees what the node
  // meant.
  auto on_value =
      [this, sp, origin](const StreamEntry& e, int64_t first, const torch::Tensor& run, bool) {
        const int64_t i = model_.plan().index(e.name);
        if (i < 0 || run.numel() == 0) {
          check_upload_run(e, run, origin);
          return;
        }
        const torch::Tensor pub =
            model_.tensors()[i].view({-1}).slice(0, first, first + run.numel());
        const double d = squared_distance(run, pub);
        // A NaN or Inf value makes the sum non-finite (the published values are finite): only
        // then is the run looked at again, to name the problem.
        if (!std::isfinite(d)) check_upload_run(e, run, origin);
        sp->diff_sq += d;
        sp->tensor_diff_sq[static_cast<size_t>(i)] += d;
        if (experts_.tracks(static_cast<size_t>(i)))
          sp->tensor_norm_sq[static_cast<size_t>(i)] += squared_norm(run);
      };
  s.decoder = std::make_unique<DeltaStreamDecoder>(
      model_.plan().compression(),
      [this](const StreamEntry& e) {
        return model_.tensors()[model_.plan().index(e.name)].view({-1});
      },
      on_value, origin, model_.plan().topk());
  s.reader->set_slice_handler(
      [sp](const StreamEntry& e, int64_t first, const torch::Tensor& run, bool last) {
        (*sp->decoder)(e, first, run, last);
      });
}

void UploadStaging::chunk(UploadStream& s, uint64_t offset, const std::string& data,
                          const std::string& checksum, uint32_t encoding) {
  s.wire += data.size();
  std::string_view fresh;
  try {
    const std::string_view raw = unpack_chunk(
        encoding, data, kMaxChunkBytes, &s.raw,
        fmt::format("upload of node {} round {}, chunk at offset {}", s.node, s.round, offset));
    fresh = s.assembly->accept(offset, raw, checksum);
    if (fresh.empty() || s.duplicate) return;
    s.reader->feed(fresh.data(), fresh.size());  // header and value checks as the bytes arrive
  } catch (const std::exception& e) {
    // A corrupt chunk is transport damage (the node sends it again); anything else wrong is
    // the sender's fault: the node is out of this round.
    const auto* se = dynamic_cast<const SyncError*>(&e);
    if (!s.duplicate && !(se && se->code() == SyncErrc::DataLoss)) reject_stream(s, e.what());
    throw;
  }
  if (std::fwrite(fresh.data(), 1, fresh.size(), s.f) != fresh.size()) {
    s.broken = true;
    sync_fail(SyncErrc::Internal, "cannot write '{}' (disk full?)", s.partial);
  }
}

UploadResult UploadStaging::finish(UploadStream& s, const std::string& expected_checksum) {
  UploadResult r;
  r.checksum = s.assembly->checksum();  // throws DataLoss unless every byte arrived
  r.bytes = s.assembly->received();
  r.accepted = true;
  r.resumed_from = s.resumed_from;
  if (s.duplicate) return finish_duplicate(s, r);
  check_stream_checksum(s, r.checksum, expected_checksum);
  check_update_bounds(s);
  close_staged_file(s, r.checksum);
  accept(s, r);
  return r;
}

UploadResult UploadStaging::finish_duplicate(UploadStream& s, UploadResult r) {
  r.duplicate = true;
  r.accepted = !s.stale;  // false: an earlier incarnation's upload is the one that counts
  s.finished = true;
  std::lock_guard<std::mutex> lk(mu_);
  if (s.round == collecting_) slots_[s.node].wire_bytes += s.wire;
  s.wire = 0;
  return r;
}

void UploadStaging::check_stream_checksum(UploadStream& s, const std::string& received,
                                          const std::string& expected) {
  // The whole stream, as assembled here (over several streams when resumed), must be the one
  // the node sent; otherwise it is sent again from the start.
  if (s.resumed_from > 0 && expected.empty()) {
    s.broken = true;
    sync_fail(SyncErrc::DataLoss, "node {} round {}: a resumed upload must carry the checksum of "
              "the whole stream (upload_checksum in its last chunk); send it again from offset 0",
              s.node, s.round);
  }
  if (!expected.empty() && expected != received) {
    s.broken = true;
    sync_fail(SyncErrc::DataLoss, "node {} round {}: the upload's bytes have checksum {} but the "
              "node sent {}; send it again from offset 0", s.node, s.round, received, expected);
  }
}

void UploadStaging::check_update_bounds(UploadStream& s) {
  try {
    s.reader->finish();
    const double limit = cfg_.spes_config.bounds.max_update_norm_ratio;
    // ||published||^2 over the tensors of this upload (all of its set: the header was checked
    // against the plan and the reader found every one complete), from the norms the update
    // bounds keep of the published model.
    double base_sq = 0;
    for (size_t i : model_.plan().upload_of(s.node)) {
      const double n = bounds_.published_norm(i);
      base_sq += n * n;
    }
    const double ratio = std::sqrt(s.diff_sq) / std::max(std::sqrt(base_sq), 1e-12);
    if (limit > 0 && ratio > limit)
      sync_fail(SyncErrc::InvalidArgument, "upload of node {} round {}: it moves the weights by "
                "{:.4g} x the norm of the published model, above "
                "spes_config.max_update_norm_ratio={}; the upload is rejected", s.node, s.round,
                ratio, limit);
    const std::string origin = fmt::format("upload of node {} round {}", s.node, s.round);
    bounds_.check_upload(s.node, s.tensor_diff_sq, origin);
    experts_.check_upload(s.node, s.tensor_norm_sq, origin);
  } catch (const std::exception& e) {
    reject_stream(s, e.what());
    throw;
  }
}

void UploadStaging::close_staged_file(UploadStream& s, const std::string& checksum) {
  const bool ok = std::fflush(s.f) == 0;
  s.close_file();
  if (!ok) sync_fail(SyncErrc::Internal, "cannot write '{}' (disk full?)", s.partial);
  if (s.resumed_from == 0) return;
  // Part of the staged file was written by an earlier stream: check it all before use.
  const std::string on_disk = file_checksum(s.partial);
  if (on_disk != checksum)
    sync_fail(SyncErrc::DataLoss, "node {} round {}: the staged upload '{}' has checksum {}, not "
              "{}; send it again from offset 0", s.node, s.round, s.partial, on_disk, checksum);
}

void UploadStaging::accept(UploadStream& s, const UploadResult& r) {
  std::lock_guard<std::mutex> lk(mu_);
  Slot& slot = slots_[s.node];
  if (s.round != collecting_ || round_closed_)
    sync_fail(SyncErrc::OutOfRange, "node {}: round {} was published without this upload "
              "(it arrived after the deadline); take the published model and carry on", s.node,
              s.round);
  if (slot.state != State::Uploading || slot.session != s.session)
    sync_fail(SyncErrc::Aborted, "node {}: this upload of round {} was superseded by another",
              s.node, s.round);
  slot.wire_bytes += s.wire;
  s.wire = 0;
  fs::rename(s.partial, s.path);
  s.partial.clear();
  s.finished = true;
  slot.accepted_incarnation = s.incarnation;
  slot.state = State::Ready;
  slot.path = s.path;
  slot.bytes_in = r.bytes;
  slot.accepted_round = s.round;
  slot.diff_sq = std::move(s.tensor_diff_sq);
  spdlog::info("round {}: upload of node {} accepted ({}, {} tokens)", s.round, s.node,
               human_bytes(static_cast<double>(r.bytes)), s.meta.tokens);
  events_.ready(s.node);
}

void UploadStaging::end(std::unique_ptr<UploadStream> sp) {
  UploadStream& s = *sp;
  std::lock_guard<std::mutex> lk(mu_);
  Slot& slot = slots_[s.node];
  const bool current = s.round == collecting_;
  if (current) slot.wire_bytes += s.wire;
  s.wire = 0;
  if (s.duplicate) return;
  const bool mine = slot.state == State::Uploading && slot.session == s.session;
  if (mine) slot.state = State::None;
  events_.stream_ended();  // resume_offset's caller waits for this stream to end
  const bool resumable = !s.broken && s.f && s.assembly->received() > 0 &&
                         !s.assembly->complete();
  if (mine && current && resumable) {
    spdlog::warn("round {}: upload of node {} interrupted after {} of {} bytes; the verified "
                 "bytes are kept for a resumed upload", s.round, s.node, s.assembly->received(),
                 s.total);
    drop_kept(s.node, "a newer interrupted stream");
    slot.kept = std::move(sp);
    return;
  }
  s.discard();
  spdlog::warn("round {}: upload of node {} dropped after {} of {} bytes", s.round, s.node,
               s.assembly->received(), s.total);
}

}  // namespace spes::sync
