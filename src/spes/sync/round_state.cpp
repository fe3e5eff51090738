// Sync server state machine (see round_state.h).
#include "spes/sync/round_state.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <filesystem>
#include <random>

#include <fmt/ranges.h>

#include "spes/common/strings.h"
#include "spes/common/sysinfo.h"
#include "spes/io/files.h"

namespace spes::sync {
namespace fs = std::filesystem;

namespace {
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double unix_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

uint64_t random_u64() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
         static_cast<uint64_t>(Clock::now().time_since_epoch().count());
}
}  // namespace

struct RoundState::NodeSlot {
  bool joined = false, left = false;
  uint64_t incarnation = 0;
  enum class Up { None, Uploading, Ready, Folded } up = Up::None;  // for round published + 1
  UploadMeta meta;
  std::string path;
  uint64_t bytes_in = 0;
  int64_t accepted_round = 0;  // latest round whose upload was accepted
};

struct RoundState::PendingLine {
  int64_t round = 0;
  nlohmann::json line;
  std::vector<uint64_t> bytes_out;
  std::vector<bool> downloaded;
  Clock::time_point published_at;
};

// ---------------------------------------------------------------------------------------------
struct UploadSession::Impl {
  RoundState* st = nullptr;
  int64_t node = 0, round = 0, step = 0;
  uint64_t total = 0, received = 0;
  bool duplicate = false, finished = false;
  std::string path, partial;
  std::FILE* f = nullptr;
  std::unique_ptr<SafetensorsStreamReader> reader;
  UploadMeta meta;
  std::unique_ptr<Sha256> whole;
};

UploadSession::UploadSession(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

UploadSession::~UploadSession() {
  if (!impl_ || impl_->finished) return;
  if (impl_->f) std::fclose(impl_->f);
  if (!impl_->partial.empty()) {
    std::error_code ec;
    fs::remove(impl_->partial, ec);
  }
  if (!impl_->duplicate) {
    std::lock_guard<std::mutex> lk(impl_->st->mu_);
    auto& slot = impl_->st->nodes_[impl_->node];
    if (slot.up == RoundState::NodeSlot::Up::Uploading) slot.up = RoundState::NodeSlot::Up::None;
  }
  spdlog::warn("round {}: upload of node {} dropped after {} of {} bytes", impl_->round,
               impl_->node, impl_->received, impl_->total);
}

void UploadSession::chunk(uint64_t offset, const std::string& data, const std::string& sha) {
  Impl& s = *impl_;
  if (data.size() > kMaxChunkBytes)
    sync_fail(SyncErrc::ResourceExhausted, "upload chunk of {} bytes exceeds the {} byte limit",
              data.size(), kMaxChunkBytes);
  if (chunk_sha256(data) != sha)
    sync_fail(SyncErrc::DataLoss, "node {} round {}: checksum mismatch in the chunk at offset {} "
              "({} bytes); the chunk is corrupt", s.node, s.round, offset, data.size());
  if (offset != s.received)
    sync_fail(SyncErrc::InvalidArgument, "node {} round {}: chunk at offset {} but {} bytes were "
              "received so far (chunks must arrive in order)", s.node, s.round, offset,
              s.received);
  if (s.received + data.size() > s.total)
    sync_fail(SyncErrc::InvalidArgument, "node {} round {}: upload runs past its declared {} "
              "bytes", s.node, s.round, s.total);
  s.whole->update(data.data(), data.size());
  s.received += data.size();
  if (s.duplicate) return;
  s.reader->feed(data.data(), data.size());  // header and value checks as the bytes arrive
  if (std::fwrite(data.data(), 1, data.size(), s.f) != data.size())
    sync_fail(SyncErrc::Internal, "cannot write '{}' (disk full?)", s.partial);
}

UploadResult UploadSession::finish() {
  Impl& s = *impl_;
  if (s.received != s.total)
    sync_fail(SyncErrc::DataLoss, "node {} round {}: upload ended after {} of {} bytes", s.node,
              s.round, s.received, s.total);
  UploadResult r;
  r.bytes = s.received;
  r.sha256 = s.whole->hex_digest();
  r.accepted = true;
  if (s.duplicate) {
    r.duplicate = true;
    s.finished = true;
    return r;
  }
  s.reader->finish();
  const bool ok = std::fflush(s.f) == 0;
  std::fclose(s.f);
  s.f = nullptr;
  if (!ok) sync_fail(SyncErrc::Internal, "cannot write '{}' (disk full?)", s.partial);
  fs::rename(s.partial, s.path);
  s.partial.clear();
  s.finished = true;
  std::lock_guard<std::mutex> lk(s.st->mu_);
  s.st->upload_done(s.node, s.round, s.meta, s.path, s.received);
  return r;
}

// ---------------------------------------------------------------------------------------------
struct DownloadSession::Impl {
  RoundState* st = nullptr;
  int64_t node = 0, round = 0;
  Selection selection = Selection::ForNode;
  uint64_t generation = 0, offset = 0;
  std::unique_ptr<SafetensorsStreamWriter> writer;
  bool reported = false;
};

DownloadSession::DownloadSession(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DownloadSession::~DownloadSession() = default;
uint64_t DownloadSession::total_bytes() const { return impl_->writer->total_bytes(); }
int64_t DownloadSession::round() const { return impl_->round; }

bool DownloadSession::next(std::string* data, uint64_t* offset) {
  Impl& s = *impl_;
  auto check_generation = [&] {
    std::lock_guard<std::mutex> lk(s.st->mu_);
    if (s.st->generation_ != s.generation)
      sync_fail(SyncErrc::Aborted, "round {} was superseded by round {} during the download; "
                "fetch the latest round", s.round, s.st->published_round_);
  };
  if (s.offset >= s.writer->total_bytes()) {
    check_generation();
    if (!s.reported) {
      s.reported = true;
      s.st->download_done(s.node, s.round, s.selection, s.writer->total_bytes());
    }
    return false;
  }
  data->clear();
  s.writer->read(s.offset, kChunkBytes, data);
  // A publication bumps the generation before it touches the tensors: checking after the
  // read proves the bytes were read from one consistent model.
  check_generation();
  *offset = s.offset;
  s.offset += data->size();
  return true;
}

// ---------------------------------------------------------------------------------------------
RoundState::RoundState(const Config& cfg, ServeOptions opts)
    : cfg_(cfg), opts_(std::move(opts)), incarnation_(random_u64()) {
  SPES_CHECK(!opts_.out_dir.empty(), "sync server: an output directory is required");
  model_ = std::make_unique<SyncModel>(cfg_);
  agg_ = std::make_unique<RoundAggregator>(*model_);
  nodes_.resize(cfg_.spes_config.num_peers);
  fs::create_directories(opts_.out_dir);
  fs::remove_all(opts_.out_dir + "/staging");
  fs::create_directories(opts_.out_dir + "/staging");
  rounds_log_ = std::fopen((opts_.out_dir + "/rounds.jsonl").c_str(), "w");
  SPES_CHECK(rounds_log_, "cannot open '{}/rounds.jsonl' for writing", opts_.out_dir);
  published_sha_ = model_->weights_sha256();
  persist(published_sha_);
  agg_->begin(1, cfg_.spes_config.sync_steps);
  spdlog::info("sync server: mode {}, {} nodes, sync every {} steps, transfer {}, model {} "
               "({:.2f}M parameters), round 0 sha256 {}", cfg_.spes_config.mode,
               nodes_.size(), cfg_.spes_config.sync_steps, cfg_.spes_config.transfer_dtype,
               model_->model_fingerprint(), [&] {
                 int64_t n = 0;
                 for (const auto& t : model_->tensors()) n += t.numel();
                 return n / 1e6;
               }(), published_sha_.substr(0, 16));
}

RoundState::~RoundState() {
  close();
  if (rounds_log_) std::fclose(rounds_log_);
}

int64_t RoundState::published_round() const {
  std::lock_guard<std::mutex> lk(mu_);
  return published_round_;
}

bool RoundState::all_left() const {
  std::lock_guard<std::mutex> lk(mu_);
  for (const auto& n : nodes_)
    if (!n.left) return false;
  return true;
}

void RoundState::check_node(const NodeId& node) const {
  if (node.node_id < 0 || node.node_id >= static_cast<int64_t>(nodes_.size()))
    sync_fail(SyncErrc::InvalidArgument, "node id {} is outside [0, num_peers={})", node.node_id,
              nodes_.size());
  const auto& slot = nodes_[node.node_id];
  if (!slot.joined || slot.incarnation != node.incarnation)
    sync_fail(SyncErrc::FailedPrecondition, "node {} (incarnation {:x}) has not joined this "
              "server (restarted node or restarted server?): join first", node.node_id,
              node.incarnation);
}

JoinResult RoundState::join(const JoinInfo& info) {
  std::lock_guard<std::mutex> lk(mu_);
  const auto& s = cfg_.spes_config;
  const int64_t id = info.node.node_id;
  if (info.protocol_version != kProtocolVersion)
    sync_fail(SyncErrc::FailedPrecondition, "node {} speaks protocol version {}, this server "
              "speaks {}", id, info.protocol_version, kProtocolVersion);
  if (id < 0 || id >= static_cast<int64_t>(nodes_.size()))
    sync_fail(SyncErrc::InvalidArgument, "node id {} is outside [0, num_peers={})", id,
              nodes_.size());
  auto setting = [&](const char* key, const std::string& node_v, const std::string& server_v) {
    if (node_v != server_v)
      sync_fail(SyncErrc::FailedPrecondition, "node {} has spes_config.{}={} but the server has "
                "{}: the server and every node must use the same spes_config", id, key, node_v,
                server_v);
  };
  setting("mode", info.mode, s.mode);
  setting("num_peers", std::to_string(info.num_peers), std::to_string(s.num_peers));
  setting("sync_steps", std::to_string(info.sync_steps), std::to_string(s.sync_steps));
  setting("transfer_dtype", info.transfer_dtype, s.transfer_dtype);
  if (info.ownership_fingerprint != model_->ownership_fingerprint())
    sync_fail(SyncErrc::FailedPrecondition, "node {}: expert ownership map differs from the "
              "server's (fingerprint {} vs {}); both must build it from the same "
              "spes_config.expert_owners / num_peers / num_train_experts_per_node", id,
              info.ownership_fingerprint, model_->ownership_fingerprint());
  if (info.model_fingerprint != model_->model_fingerprint())
    sync_fail(SyncErrc::FailedPrecondition, "node {}: model differs from the server's (tensor "
              "names/shapes fingerprint {} vs {}); use the same model config", id,
              info.model_fingerprint, model_->model_fingerprint());
  if (info.model_config_sha256 != model_config_sha256(cfg_))
    sync_fail(SyncErrc::FailedPrecondition, "node {}: the model section of its config differs "
              "from the server's (e.g. moe_top_k, rope_theta); use the same model config", id);
  if (info.step != published_step_)
    sync_fail(SyncErrc::FailedPrecondition, "node {} is at step {} but the server's latest "
              "round {} is at step {}; joining a run in progress from another step is not "
              "supported yet (start the node fresh, or restart the server)", id, info.step,
              published_round_, published_step_);
  auto& slot = nodes_[id];
  if (slot.joined && slot.incarnation != info.node.incarnation)
    spdlog::warn("node {} joined again with a new incarnation {:x} (was {:x})", id,
                 info.node.incarnation, slot.incarnation);
  slot.joined = true;
  slot.left = false;
  slot.incarnation = info.node.incarnation;
  spdlog::info("node {} joined (incarnation {:x}) at round {}", id, info.node.incarnation,
               published_round_);
  JoinResult r;
  r.server_incarnation = incarnation_;
  r.published_round = published_round_;
  r.published_step = published_step_;
  r.model_sha256 = published_sha_;
  r.max_chunk_bytes = kMaxChunkBytes;
  return r;
}

std::string RoundState::staged_path(int64_t round, int64_t node) const {
  if (opts_.keep_uploads)
    return fmt::format("{}/rounds/{}/node{}.safetensors", opts_.out_dir, round, node);
  return fmt::format("{}/staging/round{}.node{}.safetensors", opts_.out_dir, round, node);
}

std::unique_ptr<UploadSession> RoundState::begin_upload(const NodeId& node, int64_t round,
                                                        int64_t step, uint64_t total_bytes) {
  auto impl = std::make_unique<UploadSession::Impl>();
  impl->st = this;
  impl->node = node.node_id;
  impl->round = round;
  impl->step = step;
  impl->total = total_bytes;
  impl->whole = std::make_unique<Sha256>();
  {
    std::lock_guard<std::mutex> lk(mu_);
    check_node(node);
    const int64_t H = cfg_.spes_config.sync_steps;
    if (step != round * H)
      sync_fail(SyncErrc::InvalidArgument, "node {}: round {} is step {}, not {}", node.node_id,
                round, round * H, step);
    auto& slot = nodes_[node.node_id];
    if (slot.accepted_round == round) {
      impl->duplicate = true;  // already accepted (a retry whose reply was lost): ignore it
    } else if (round != published_round_ + 1) {
      sync_fail(SyncErrc::FailedPrecondition, "node {}: upload for round {} refused: the server "
                "collects round {} (latest published {})", node.node_id, round,
                published_round_ + 1, published_round_);
    } else if (slot.up == NodeSlot::Up::Uploading) {
      sync_fail(SyncErrc::Aborted, "node {}: an upload for round {} is already in progress",
                node.node_id, round);
    } else {
      const uint64_t limit = 8 + kMaxHeaderBytes + model_->plan().upload_data_bytes(node.node_id);
      if (total_bytes < 8 || total_bytes > limit)
        sync_fail(SyncErrc::ResourceExhausted, "node {}: an upload of {} bytes is impossible "
                  "(its tensors take at most {} bytes)", node.node_id, total_bytes, limit);
      slot.up = NodeSlot::Up::Uploading;
      if (!round_started_) {
        round_started_ = true;
        round_start_ = last_wait_log_ = Clock::now();
      }
    }
  }
  // From here on the session's destructor cleans up (file, slot) whatever goes wrong.
  UploadSession::Impl* s = impl.get();
  std::unique_ptr<UploadSession> session(new UploadSession(std::move(impl)));
  if (!s->duplicate) {
    s->path = staged_path(round, node.node_id);
    s->partial = s->path + ".partial";
    fs::create_directories(fs::path(s->path).parent_path());
    s->f = std::fopen(s->partial.c_str(), "wb");
    if (!s->f) sync_fail(SyncErrc::Internal, "cannot create '{}'", s->partial);
    const std::string origin = fmt::format("upload of node {} round {}", node.node_id, round);
    s->reader = std::make_unique<SafetensorsStreamReader>(
        total_bytes, origin,
        [this, s, origin](const StreamHeader& h) {
          s->meta = check_upload_header(model_->plan(), h, s->node, origin);
          if (s->meta.round != s->round || s->meta.step != s->step)
            sync_fail(SyncErrc::InvalidArgument, "{}: payload says round {} step {}", origin,
                      s->meta.round, s->meta.step);
        },
        nullptr, kMaxHeaderBytes);
    // Values are checked piece by piece as they arrive (memory: one chunk per upload).
    s->reader->set_slice_handler(
        [origin](const StreamEntry& e, int64_t, const torch::Tensor& run, bool) {
          check_upload_run(e, run, origin);
        });
  }
  return session;
}

void RoundState::upload_done(int64_t node, int64_t round, const UploadMeta& meta,
                             const std::string& path, uint64_t bytes) {
  auto& slot = nodes_[node];
  slot.up = NodeSlot::Up::Ready;
  slot.meta = meta;
  slot.path = path;
  slot.bytes_in = bytes;
  slot.accepted_round = round;
  spdlog::info("round {}: upload of node {} accepted ({}, {} tokens)", round, node,
               human_bytes(static_cast<double>(bytes)), meta.tokens);
  fold_ready();
}

void RoundState::fold_ready() {
  const int64_t N = static_cast<int64_t>(nodes_.size());
  while (next_fold_ < N && nodes_[next_fold_].up == NodeSlot::Up::Ready) {
    auto& slot = nodes_[next_fold_];
    fold_upload_file(*agg_, model_->plan(), slot.path, next_fold_);
    slot.up = NodeSlot::Up::Folded;
    ++next_fold_;
  }
  if (next_fold_ < N) return;
  publish();  // reads the owner copies back from the staged files
  if (!opts_.keep_uploads)
    for (int64_t i = 0; i < N; ++i) {
      std::error_code ec;
      fs::remove(staged_path(published_round_, i), ec);
    }
}

void RoundState::publish() {
  ++generation_;  // before the tensors change: downloads in flight abort (see next())
  const auto t0 = Clock::now();
  const RoundOutcome o = agg_->finish();
  const double aggregate_s = seconds_since(t0);
  const std::string sha = model_->weights_sha256();
  const auto t1 = Clock::now();
  published_round_ = o.round;
  published_step_ = o.step;
  published_alpha_ = o.alpha;
  published_merged_ = o.merged;
  persist(sha);
  const double persist_s = seconds_since(t1);
  published_sha_ = sha;
  const int64_t N = static_cast<int64_t>(nodes_.size());
  PendingLine pl;
  pl.round = o.round;
  pl.published_at = Clock::now();
  pl.bytes_out.assign(N, 0);
  pl.downloaded.assign(N, false);
  std::vector<uint64_t> bytes_in(N);
  uint64_t total_in = 0;
  for (int64_t i = 0; i < N; ++i) {
    bytes_in[i] = nodes_[i].bytes_in;
    total_in += bytes_in[i];
    nodes_[i].up = NodeSlot::Up::None;
    nodes_[i].bytes_in = 0;
  }
  const double seconds = round_started_ ? seconds_since(round_start_) : 0.0;
  pl.line = {{"round", o.round},
             {"step", o.step},
             {"nodes", o.nodes},
             {"tokens", o.tokens},
             {"weights", o.weights},
             {"bytes_in", total_in},
             {"bytes_in_per_node", bytes_in},
             {"alpha", o.alpha},
             {"merged", o.merged},
             {"gate_cos", o.gate_cos},
             {"seconds", seconds},
             {"aggregate_s", aggregate_s},
             {"persist_s", persist_s},
             {"model_sha256", sha}};
  if (o.merged) pl.line["gate_cos_before"] = o.gate_cos_before;
  pending_.push_back(std::move(pl));
  next_fold_ = 0;
  round_started_ = false;
  agg_->begin(o.round + 1, (o.round + 1) * cfg_.spes_config.sync_steps);
  spdlog::info("round {} (step {}) published: {} nodes, {} in, alpha {:.4g}, aggregate {:.2f} s, "
               "persist {:.2f} s, sha256 {}", o.round, o.step, o.nodes.size(),
               human_bytes(static_cast<double>(total_in)), o.alpha, aggregate_s, persist_s,
               sha.substr(0, 16));
  cv_.notify_all();
}

void RoundState::persist(const std::string& sha) {
  const std::string dir = opts_.out_dir;
  write_stream_file(dir + "/published.safetensors",
                    published_writer(*model_, published_round_, published_step_, sha));
  const bool diloco = cfg_.spes_config.mode == "diloco";
  if (diloco)
    write_stream_file(dir + "/momentum.safetensors",
                      SafetensorsStreamWriter(model_->momentum_named(), torch::kFloat32,
                                              {{"format", "spes-momentum-v1"},
                                               {"round", std::to_string(published_round_)}}));
  const nlohmann::json st = {{"format", "spes-server-state-v1"},
                             {"round", published_round_},
                             {"step", published_step_},
                             {"model_sha256", sha},
                             {"mode", cfg_.spes_config.mode},
                             {"model_fingerprint", model_->model_fingerprint()},
                             {"ownership_fingerprint", model_->ownership_fingerprint()},
                             {"server_incarnation", incarnation_},
                             {"time", unix_time()}};
  file_write_atomic(dir + "/state.json", st.dump(2));
  if (opts_.keep_uploads) {
    const std::string rdir = fmt::format("{}/rounds/{}", dir, published_round_);
    fs::create_directories(rdir);
    auto keep = [&](const std::string& name) {
      std::error_code ec;
      fs::remove(rdir + "/" + name, ec);
      fs::create_hard_link(dir + "/" + name, rdir + "/" + name, ec);
      if (ec) fs::copy_file(dir + "/" + name, rdir + "/" + name);
    };
    keep("published.safetensors");
    if (diloco) keep("momentum.safetensors");
  }
}

RoundStatus RoundState::wait_round(const NodeId& node, int64_t round, uint32_t max_wait_ms) {
  std::unique_lock<std::mutex> lk(mu_);
  check_node(node);
  const auto deadline =
      Clock::now() + std::chrono::milliseconds(std::min<uint32_t>(max_wait_ms, kMaxWaitMs));
  cv_.wait_until(lk, deadline, [&] { return published_round_ >= round || closed_; });
  RoundStatus r;
  r.round = round;
  r.published_round = published_round_;
  r.step = round * cfg_.spes_config.sync_steps;
  r.published = published_round_ >= round;
  if (r.published && round == published_round_) {
    r.model_sha256 = published_sha_;
    r.alpha = published_alpha_;
    r.download_bytes = download_writer(node.node_id, round, Selection::ForNode)->total_bytes();
  }
  if (!r.published && round == published_round_ + 1)
    for (size_t i = 0; i < nodes_.size(); ++i)
      if (nodes_[i].up != NodeSlot::Up::Ready && nodes_[i].up != NodeSlot::Up::Folded)
        r.waiting_for.push_back(static_cast<int64_t>(i));
  return r;
}

std::unique_ptr<DownloadSession> RoundState::begin_download(const NodeId& node, int64_t round,
                                                            Selection selection) {
  std::lock_guard<std::mutex> lk(mu_);
  check_node(node);
  if (round != published_round_)
    sync_fail(SyncErrc::FailedPrecondition, "node {}: round {} is {}; the latest published "
              "round is {}", node.node_id, round,
              round > published_round_ ? "not published yet" : "no longer available",
              published_round_);
  auto impl = std::make_unique<DownloadSession::Impl>();
  impl->st = this;
  impl->node = node.node_id;
  impl->round = round;
  impl->selection = selection;
  impl->generation = generation_;
  impl->writer = download_writer(node.node_id, round, selection);
  return std::unique_ptr<DownloadSession>(new DownloadSession(std::move(impl)));
}

std::unique_ptr<SafetensorsStreamWriter> RoundState::download_writer(int64_t node, int64_t round,
                                                                     Selection selection) const {
  const RoundPlan& plan = model_->plan();
  std::vector<size_t> idx;
  if (selection == Selection::All || round == 0) {
    for (size_t i = 0; i < plan.tensors().size(); ++i) idx.push_back(i);
  } else {
    idx = plan.download_for(node, published_merged_);
  }
  NamedTensors sel;
  for (size_t i : idx) sel.emplace_back(plan.tensors()[i].name, model_->tensors()[i]);
  return std::make_unique<SafetensorsStreamWriter>(
      std::move(sel), wire_scalar_type(plan.wire()),
      Metadata{{"format", "spes-download-v1"},
               {"round", std::to_string(round)},
               {"step", std::to_string(published_step_)},
               {"model_sha256", published_sha_},
               {"selection", selection == Selection::All ? "all" : "for_node"}});
}

void RoundState::download_done(int64_t node, int64_t round, Selection selection,
                               uint64_t bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  if (selection == Selection::All || round == 0) {
    spdlog::info("node {} downloaded the whole model of round {} ({})", node, round,
                 human_bytes(static_cast<double>(bytes)));
    return;
  }
  for (size_t k = 0; k < pending_.size(); ++k) {
    PendingLine& pl = pending_[k];
    if (pl.round != round) continue;
    pl.bytes_out[node] += bytes;
    pl.downloaded[node] = true;
    if (std::all_of(pl.downloaded.begin(), pl.downloaded.end(), [](bool b) { return b; })) {
      write_line(pl);
      pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(k));
    }
    return;
  }
}

void RoundState::write_line(PendingLine& pl) {
  uint64_t total = 0;
  for (uint64_t b : pl.bytes_out) total += b;
  pl.line["bytes_out"] = total;
  pl.line["bytes_out_per_node"] = pl.bytes_out;
  pl.line["download_s"] = seconds_since(pl.published_at);
  pl.line["downloads_complete"] =
      std::all_of(pl.downloaded.begin(), pl.downloaded.end(), [](bool b) { return b; });
  pl.line["peak_rss_mb"] = peak_rss_mb();
  pl.line["time"] = unix_time();
  const std::string s = pl.line.dump() + "\n";
  std::fwrite(s.data(), 1, s.size(), rounds_log_);
  std::fflush(rounds_log_);
}

void RoundState::leave(const NodeId& node, int64_t step, const std::string& reason) {
  std::lock_guard<std::mutex> lk(mu_);
  check_node(node);
  nodes_[node.node_id].left = true;
  spdlog::info("node {} left at step {}{}{}", node.node_id, step, reason.empty() ? "" : ": ",
               reason);
}

void RoundState::tick() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!round_started_ || closed_ || seconds_since(last_wait_log_) < opts_.wait_log_s) return;
  last_wait_log_ = Clock::now();
  std::vector<size_t> waiting;
  for (size_t i = 0; i < nodes_.size(); ++i)
    if (nodes_[i].up != NodeSlot::Up::Ready && nodes_[i].up != NodeSlot::Up::Folded)
      waiting.push_back(i);
  spdlog::info("round {}: waiting for the upload of node(s) [{}] for {:.0f} s ({} of {} in)",
               published_round_ + 1, fmt::join(waiting, ", "), seconds_since(round_start_),
               nodes_.size() - waiting.size(), nodes_.size());
}

void RoundState::close() {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return;
  closed_ = true;
  for (auto& pl : pending_) write_line(pl);
  pending_.clear();
  cv_.notify_all();
}

}  // namespace spes::sync
