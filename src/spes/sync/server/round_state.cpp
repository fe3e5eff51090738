// Sync server state machine (see round_state.h).
#include "spes/sync/server/round_state.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include <fmt/ranges.h>

#include "spes/common/strings.h"
#include "spes/common/sysinfo.h"
#include "spes/io/files.h"
#include "spes/sync/server/upload_assembly.h"
#include "spes/sync/wire/auth.h"

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

// Hex SHA-256 of a file, read a piece at a time.
std::string file_sha256(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) sync_fail(SyncErrc::Internal, "cannot open '{}' to check it", path);
  Sha256 h;
  std::string buf(4u << 20, '\0');
  size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), f)) > 0) h.update(buf.data(), n);
  const bool bad = std::ferror(f) != 0;
  std::fclose(f);
  if (bad) sync_fail(SyncErrc::Internal, "cannot read '{}' to check it", path);
  return h.hex_digest();
}

uint64_t random_u64() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
         static_cast<uint64_t>(Clock::now().time_since_epoch().count());
}
}  // namespace

// One upload's state; kept in its node's slot (`kept`) while a broken stream waits for a resume.
struct UploadSession::Impl {
  RoundState* st = nullptr;
  int64_t node = 0, round = 0, step = 0;
  uint64_t total = 0, session = 0, incarnation = 0;
  uint64_t wire = 0;  // chunk bytes this stream received (repeats included), not yet counted
  uint64_t resumed_from = 0;  // bytes kept from an interrupted stream when this one resumed it
  bool duplicate = false, stale = false, finished = false;
  bool broken = false;        // the staged bytes may not match `received`: never resume this
  std::string path, partial;
  std::FILE* f = nullptr;
  std::unique_ptr<SafetensorsStreamReader> reader;
  UploadMeta meta;
  std::unique_ptr<UploadAssembly> assembly;  // chunk checks, bytes received, whole digest
  double diff_sq = 0, base_sq = 0;  // ||upload - published||^2, ||published||^2
  ~Impl() {
    if (f) std::fclose(f);
  }
};

struct RoundState::NodeSlot {
  bool joined = false, left = false;
  uint64_t incarnation = 0;
  // For round published + 1. Rejected: its upload failed a check; it is out of the round.
  enum class Up { None, Uploading, Ready, Folded, Rejected } up = Up::None;
  uint64_t session = 0;        // the upload session that owns `Uploading`
  UploadMeta meta;
  std::string path;
  uint64_t bytes_in = 0;
  int64_t accepted_round = 0;  // latest round whose upload was accepted
  uint64_t accepted_incarnation = 0;  // the node incarnation that sent it
  int64_t step = 0;            // last step the node reported
  bool seen = false;
  Clock::time_point last_seen;
  std::string detail;          // why its last upload was rejected
  bool dead_logged = false;
  double loss = NAN, tokens_per_s = NAN;  // from its last heartbeat
  LossHistory losses;
  // An interrupted upload of this incarnation for round published + 1, kept for a resume.
  std::unique_ptr<UploadSession::Impl> kept;
  uint64_t wire_bytes = 0;     // chunk bytes received for round published + 1, every stream
  uint64_t resumed_bytes = 0;  // bytes of it that resumed streams did not need to send again
};

struct RoundState::PendingLine {
  int64_t round = 0;
  nlohmann::json line;
  std::vector<uint64_t> bytes_out;
  std::vector<bool> downloaded;
  Clock::time_point published_at;
};

// ---------------------------------------------------------------------------------------------

UploadSession::UploadSession(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

UploadSession::~UploadSession() {
  if (!impl_ || impl_->finished) return;
  Impl& s = *impl_;
  RoundState* st = s.st;
  std::lock_guard<std::mutex> lk(st->mu_);
  auto& slot = st->nodes_[s.node];
  const bool current = s.round == st->published_round_ + 1;
  if (current) slot.wire_bytes += s.wire;
  s.wire = 0;
  if (s.duplicate) return;
  const bool mine = slot.up == RoundState::NodeSlot::Up::Uploading && slot.session == s.session;
  if (mine) slot.up = RoundState::NodeSlot::Up::None;
  st->cv_.notify_all();  // upload_resume_offset waits for this stream to end
  const bool resumable = !s.broken && s.f && s.assembly->received() > 0 &&
                         !s.assembly->complete();
  if (mine && current && resumable) {
    spdlog::warn("round {}: upload of node {} interrupted after {} of {} bytes; the verified "
                 "bytes are kept for a resumed upload", s.round, s.node, s.assembly->received(),
                 s.total);
    st->drop_kept_upload(slot, "a newer interrupted stream");
    slot.kept = std::move(impl_);
    return;
  }
  if (s.f) std::fclose(s.f);
  s.f = nullptr;
  if (!s.partial.empty()) {
    std::error_code ec;
    fs::remove(s.partial, ec);
  }
  spdlog::warn("round {}: upload of node {} dropped after {} of {} bytes", s.round, s.node,
               s.assembly->received(), s.total);
}

void UploadSession::chunk(uint64_t offset, const std::string& data, const std::string& sha) {
  Impl& s = *impl_;
  s.wire += data.size();
  std::string_view fresh;
  try {
    fresh = s.assembly->accept(offset, data, sha);
    if (fresh.empty() || s.duplicate) return;
    s.reader->feed(fresh.data(), fresh.size());  // header and value checks as the bytes arrive
  } catch (const std::exception& e) {
    // A corrupt chunk is transport damage (the node sends it again); anything else wrong is
    // the sender's fault: the node is out of this round.
    const auto* se = dynamic_cast<const SyncError*>(&e);
    if (!s.duplicate && !(se && se->code() == SyncErrc::DataLoss))
      s.st->reject_upload(s.node, s.round, s.session, e.what());
    throw;
  }
  if (std::fwrite(fresh.data(), 1, fresh.size(), s.f) != fresh.size()) {
    s.broken = true;
    sync_fail(SyncErrc::Internal, "cannot write '{}' (disk full?)", s.partial);
  }
}

UploadResult UploadSession::finish(const std::string& expected_sha256) {
  Impl& s = *impl_;
  UploadResult r;
  r.sha256 = s.assembly->sha256();  // throws DataLoss unless every byte arrived
  r.bytes = s.assembly->received();
  r.accepted = true;
  r.resumed_from = s.resumed_from;
  if (s.duplicate) {
    r.duplicate = true;
    r.accepted = !s.stale;  // false: an earlier incarnation's upload is the one that counts
    s.finished = true;
    std::lock_guard<std::mutex> lk(s.st->mu_);
    if (s.round == s.st->published_round_ + 1) s.st->nodes_[s.node].wire_bytes += s.wire;
    s.wire = 0;
    return r;
  }
  // The whole stream, as assembled here (over several streams when resumed), must be the one
  // the node sent; otherwise it is sent again from the start.
  if (s.resumed_from > 0 && expected_sha256.empty()) {
    s.broken = true;
    sync_fail(SyncErrc::DataLoss, "node {} round {}: a resumed upload must carry the SHA-256 of "
              "the whole stream (upload_sha256 in its last chunk); send it again from offset 0",
              s.node, s.round);
  }
  if (!expected_sha256.empty() && expected_sha256 != r.sha256) {
    s.broken = true;
    sync_fail(SyncErrc::DataLoss, "node {} round {}: the upload's bytes hash to {} but the node "
              "sent {}; send it again from offset 0", s.node, s.round, r.sha256,
              expected_sha256);
  }
  try {
    s.reader->finish();
    const double limit = s.st->cfg_.spes_config.max_update_norm_ratio;
    const double ratio = std::sqrt(s.diff_sq) / std::max(std::sqrt(s.base_sq), 1e-12);
    if (limit > 0 && ratio > limit)
      sync_fail(SyncErrc::InvalidArgument, "upload of node {} round {}: it moves the weights by "
                "{:.4g} x the norm of the published model, above "
                "spes_config.max_update_norm_ratio={}; the upload is rejected", s.node, s.round,
                ratio, limit);
  } catch (const std::exception& e) {
    s.st->reject_upload(s.node, s.round, s.session, e.what());
    throw;
  }
  const bool ok = std::fflush(s.f) == 0;
  std::fclose(s.f);
  s.f = nullptr;
  if (!ok) sync_fail(SyncErrc::Internal, "cannot write '{}' (disk full?)", s.partial);
  if (s.resumed_from > 0) {
    // Part of the staged file was written by an earlier stream: check it all before use.
    const std::string on_disk = file_sha256(s.partial);
    if (on_disk != r.sha256)
      sync_fail(SyncErrc::DataLoss, "node {} round {}: the staged upload '{}' hashes to {}, not "
                "{}; send it again from offset 0", s.node, s.round, s.partial, on_disk, r.sha256);
  }
  std::lock_guard<std::mutex> lk(s.st->mu_);
  auto& slot = s.st->nodes_[s.node];
  if (s.round != s.st->published_round_ + 1)
    sync_fail(SyncErrc::OutOfRange, "node {}: round {} was published without this upload "
              "(it arrived after the deadline); take the published model and carry on", s.node,
              s.round);
  if (slot.up != RoundState::NodeSlot::Up::Uploading || slot.session != s.session)
    sync_fail(SyncErrc::Aborted, "node {}: this upload of round {} was superseded by another",
              s.node, s.round);
  slot.wire_bytes += s.wire;
  s.wire = 0;
  fs::rename(s.partial, s.path);
  s.partial.clear();
  s.finished = true;
  slot.accepted_incarnation = s.incarnation;
  s.st->upload_done(s.node, s.round, s.meta, s.path, r.bytes);
  return r;
}

// ---------------------------------------------------------------------------------------------
struct DownloadSession::Impl {
  RoundState* st = nullptr;
  int64_t node = 0, round = 0;
  Selection selection = Selection::ForNode;
  uint64_t offset = 0, start = 0;
  std::unique_ptr<SafetensorsStreamWriter> writer;
  bool reported = false;
};

DownloadSession::DownloadSession(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DownloadSession::~DownloadSession() = default;
uint64_t DownloadSession::total_bytes() const { return impl_->writer->total_bytes(); }
int64_t DownloadSession::round() const { return impl_->round; }

bool DownloadSession::next(std::string* data, uint64_t* offset) {
  Impl& s = *impl_;
  if (s.offset >= s.writer->total_bytes()) {
    if (!s.reported) {
      s.reported = true;
      s.st->download_done(s.node, s.round, s.selection, s.writer->total_bytes() - s.start);
    }
    return false;
  }
  data->clear();
  // The writer reads the persisted file through a descriptor opened when the download began:
  // a later publication (a rename over the file) does not change these bytes.
  s.writer->read(s.offset, kChunkBytes, data);
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
  if (!cfg_.spes_config.auth_tokens_file.empty())
    tokens_ = load_node_tokens(cfg_.spes_config.auth_tokens_file, cfg_.spes_config.num_peers);
  fs::create_directories(opts_.out_dir);
  fs::remove_all(opts_.out_dir + "/staging");
  fs::create_directories(opts_.out_dir + "/staging");
  const bool resumed = opts_.resume && resume_from_dir();
  rounds_log_ = std::fopen((opts_.out_dir + "/rounds.jsonl").c_str(), resumed ? "a" : "w");
  SPES_CHECK(rounds_log_, "cannot open '{}/rounds.jsonl' for writing", opts_.out_dir);
  if (resumed) {
    // A round published just before a crash may lack its rounds.jsonl line (lines are written
    // when every node has downloaded): write it from state.json, marked recovered.
    int64_t last_line = 0;
    {
      std::ifstream in(opts_.out_dir + "/rounds.jsonl");
      std::string text;
      while (std::getline(in, text)) {
        const auto l = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
        if (!l.is_object()) continue;
        last_line = std::max<int64_t>(last_line, l.value("round", int64_t{0}));
        remember_round(l);
      }
    }
    const nlohmann::json st = nlohmann::json::parse(file_read(opts_.out_dir + "/state.json"));
    if (last_line < published_round_ && st.contains("line") && st["line"].is_object()) {
      nlohmann::json line = st["line"];
      line["recovered"] = true;
      line["downloads_complete"] = false;
      remember_round(line);
      const std::string txt = line.dump() + "\n";
      std::fwrite(txt.data(), 1, txt.size(), rounds_log_);
      std::fflush(rounds_log_);
    }
  } else {
    published_sha_ = model_->weights_sha256();
    persist(published_sha_, nlohmann::json());
  }
  agg_->begin(published_round_ + 1, (published_round_ + 1) * cfg_.spes_config.sync_steps);
  spdlog::info("sync server: mode {}, {} nodes, sync every {} steps, transfer {}, model {} "
               "({:.2f}M parameters), {} round {} sha256 {}; deadline {} s, quorum {}, {}",
               cfg_.spes_config.mode, nodes_.size(), cfg_.spes_config.sync_steps,
               cfg_.spes_config.transfer_dtype, model_->model_fingerprint(), [&] {
                 int64_t n = 0;
                 for (const auto& t : model_->tensors()) n += t.numel();
                 return n / 1e6;
               }(), resumed ? "resumed at" : "initial", published_round_,
               published_sha_.substr(0, 16), cfg_.spes_config.round_timeout,
               cfg_.spes_config.min_nodes,
               tokens_.empty() ? "no node tokens (loopback only)" : "node tokens required");
}

bool RoundState::resume_from_dir() {
  const std::string dir = opts_.out_dir;
  if (!fs::exists(dir + "/state.json")) return false;
  nlohmann::json st;
  try {
    st = nlohmann::json::parse(file_read(dir + "/state.json"));
  } catch (const std::exception& e) {
    fail("'{}/state.json' is corrupt ({}); restore it or start over with --overwrite", dir,
         e.what());
  }
  SPES_CHECK(st.value("format", "") == "spes-server-state-v1", "'{}/state.json' is not a sync "
             "server state; start over with --overwrite", dir);
  auto same = [&](const char* key, const std::string& mine) {
    SPES_CHECK(st.value(key, "") == mine, "'{}' holds a run with a different {} ({} vs {}); "
               "use the same config, another --out, or --overwrite to start over", dir, key,
               st.value(key, ""), mine);
  };
  same("mode", cfg_.spes_config.mode);
  same("model_fingerprint", model_->model_fingerprint());
  same("ownership_fingerprint", model_->ownership_fingerprint());
  // The published file is authoritative (it is renamed into place before state.json): load it
  // piece by piece into the model and check its digest.
  const std::string path = published_path();
  SPES_CHECK(fs::exists(path), "'{}' has state.json but no published.safetensors; restore it "
             "or start over with --overwrite", dir);
  const StreamHeader h = read_stream_header(path);
  const RoundPlan& plan = model_->plan();
  SPES_CHECK(h.entries.size() == plan.tensors().size(), "'{}' holds {} tensors, the model has "
             "{}; start over with --overwrite", path, h.entries.size(), plan.tensors().size());
  SafetensorsStreamReader reader(fs::file_size(path), path, [&](const StreamHeader& hh) {
    for (const auto& e : hh.entries) {
      const int64_t i = plan.index(e.name);
      SPES_CHECK(i >= 0 && e.shape == plan.tensors()[i].shape && e.dtype == torch::kFloat32,
                 "'{}': tensor '{}' does not match the model", path, e.name);
    }
  }, nullptr);
  reader.set_slice_handler([&](const StreamEntry& e, int64_t first, const torch::Tensor& run,
                               bool) {
    torch::NoGradGuard ng;
    model_->tensors()[plan.index(e.name)].view({-1}).slice(0, first, first + run.numel())
        .copy_(run);
  });
  stream_file(path, reader);
  const Metadata& md = h.metadata;
  SPES_CHECK(md.count("round") && md.count("step") && md.count("model_sha256"),
             "'{}' lacks its round metadata; start over with --overwrite", path);
  const std::string sha = model_->weights_sha256();
  SPES_CHECK(sha == md.at("model_sha256"), "'{}' is corrupt: its weights hash to {} but it was "
             "written with {}; restore it or start over with --overwrite", path, sha,
             md.at("model_sha256"));
  published_round_ = std::stoll(md.at("round"));
  published_step_ = std::stoll(md.at("step"));
  published_sha_ = sha;
  if (st.value("round", int64_t{-1}) == published_round_) {
    published_alpha_ = st.value("alpha", 0.0);
    published_merged_ = st.value("merged", false);
    published_nodes_ = st.value("nodes", std::vector<int64_t>{});
  }
  if (cfg_.spes_config.mode == "diloco") {
    const std::string mpath = fmt::format("{}/momentum-{}.safetensors", dir, published_round_);
    if (published_round_ > 0) {
      SPES_CHECK(fs::exists(mpath), "'{}' is missing (diloco momentum of round {}); start over "
                 "with --overwrite", mpath, published_round_);
      model_->load_momentum(safetensors_load(mpath), mpath);
    }
  }
  spdlog::info("sync server: resuming from '{}' at round {} (step {})", dir, published_round_,
               published_step_);
  return true;
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

void RoundState::check_token(const NodeId& node) const {
  if (node.node_id < 0 || node.node_id >= static_cast<int64_t>(nodes_.size()))
    sync_fail(SyncErrc::PermissionDenied, "node id {} is outside [0, num_peers={})",
              node.node_id, nodes_.size());
  if (!tokens_.empty() && !token_equal(node.auth_token, tokens_[node.node_id]))
    sync_fail(SyncErrc::PermissionDenied, "node {}: wrong or missing token (set the node's "
              "token from spes_config.auth_tokens_file with --token-file or SPES_NODE_TOKEN)",
              node.node_id);
}

void RoundState::check_node(const NodeId& node) {
  check_token(node);
  auto& slot = nodes_[node.node_id];
  if (!slot.joined || slot.incarnation != node.incarnation)
    sync_fail(SyncErrc::NotJoined, "node {} (incarnation {:x}) has not joined this server "
              "(restarted node or restarted server?): join first", node.node_id,
              node.incarnation);
  slot.seen = true;
  slot.last_seen = Clock::now();
}

JoinResult RoundState::join(const JoinInfo& info) {
  std::lock_guard<std::mutex> lk(mu_);
  const auto& s = cfg_.spes_config;
  const int64_t id = info.node.node_id;
  check_token(info.node);
  if (info.protocol_version != kProtocolVersion)
    sync_fail(SyncErrc::FailedPrecondition, "node {} speaks protocol version {}, this server "
              "speaks {}", id, info.protocol_version, kProtocolVersion);
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
  // A node at another step joins too: it decides from the reply whether to keep its weights
  // (checkpoint taken after the published round) or to take the published model.
  auto& slot = nodes_[id];
  if (slot.joined && slot.incarnation != info.node.incarnation)
    spdlog::warn("node {} joined again with a new incarnation {:x} (was {:x})", id,
                 info.node.incarnation, slot.incarnation);
  if (slot.incarnation != info.node.incarnation) drop_kept_upload(slot, "the node restarted");
  slot.joined = true;
  slot.left = false;
  slot.incarnation = info.node.incarnation;
  slot.step = info.step;
  slot.seen = true;
  slot.last_seen = Clock::now();
  spdlog::info("node {} joined (incarnation {:x}, step {}) at round {}", id,
               info.node.incarnation, info.step, published_round_);
  JoinResult r;
  r.server_incarnation = incarnation_;
  r.published_round = published_round_;
  r.published_step = published_step_;
  r.model_sha256 = published_sha_;
  r.max_chunk_bytes = kMaxChunkBytes;
  // A quarter of the timeout, and at most 5 s: heartbeats also carry the node's loss and
  // throughput for `spes status` and the dashboard.
  r.heartbeat_interval_ms = static_cast<uint32_t>(
      std::clamp(cfg_.spes_config.heartbeat_timeout * 1000 / 4, 100.0, 5000.0));
  r.published_nodes = published_nodes_;
  return r;
}

std::string RoundState::staged_path(int64_t round, int64_t node) const {
  if (opts_.keep_uploads)
    return fmt::format("{}/rounds/{}/node{}.safetensors", opts_.out_dir, round, node);
  return fmt::format("{}/staging/round{}.node{}.safetensors", opts_.out_dir, round, node);
}

void RoundState::drop_kept_upload(NodeSlot& slot, const char* why) {
  if (!slot.kept) return;
  UploadSession::Impl& k = *slot.kept;
  spdlog::info("round {}: dropping the {} bytes kept of node {}'s interrupted upload ({})",
               k.round, k.assembly->received(), k.node, why);
  if (k.f) std::fclose(k.f);
  k.f = nullptr;
  std::error_code ec;
  fs::remove(k.partial, ec);
  slot.kept.reset();
}

uint64_t RoundState::upload_resume_offset(const NodeId& node, int64_t round, int64_t step,
                                          uint64_t total_bytes) {
  std::unique_lock<std::mutex> lk(mu_);
  check_node(node);
  auto& slot = nodes_[node.node_id];
  // The node's previous stream may still look open here (its end not processed yet).
  cv_.wait_for(lk, std::chrono::seconds(5),
               [&] { return slot.up != NodeSlot::Up::Uploading || closed_; });
  const UploadSession::Impl* k = slot.kept.get();
  if (!k || k->incarnation != node.incarnation || k->round != round || k->step != step ||
      k->total != total_bytes || round != published_round_ + 1)
    return 0;
  return k->assembly->received();
}

std::unique_ptr<UploadSession> RoundState::begin_upload(const NodeId& node, int64_t round,
                                                        int64_t step, uint64_t total_bytes,
                                                        uint64_t offset) {
  auto impl = std::make_unique<UploadSession::Impl>();
  impl->st = this;
  impl->node = node.node_id;
  impl->round = round;
  impl->step = step;
  impl->total = total_bytes;
  impl->incarnation = node.incarnation;
  impl->assembly = std::make_unique<UploadAssembly>(
      total_bytes, fmt::format("node {} round {}", node.node_id, round));
  {
    std::lock_guard<std::mutex> lk(mu_);
    check_node(node);
    const int64_t H = cfg_.spes_config.sync_steps;
    if (step != round * H)
      sync_fail(SyncErrc::InvalidArgument, "node {}: round {} is step {}, not {}", node.node_id,
                round, round * H, step);
    auto& slot = nodes_[node.node_id];
    slot.step = step;
    if (offset > 0) {
      // A resume must continue the upload kept from this incarnation's interrupted stream.
      const UploadSession::Impl* k = slot.kept.get();
      const bool same = k && k->incarnation == node.incarnation && k->round == round &&
                        k->step == step && k->total == total_bytes;
      const uint64_t held = same ? k->assembly->received() : 0;
      if (!same || offset > held || slot.accepted_round == round ||
          slot.up != NodeSlot::Up::None)
        sync_fail(SyncErrc::DataLoss, "node {}: cannot resume the round {} upload at offset {}: "
                  "the server holds {} bytes of it; ask where to resume again (resume_query) or "
                  "send it from offset 0", node.node_id, round, offset, held);
      impl = std::move(slot.kept);
      impl->resumed_from = impl->assembly->received();
      slot.resumed_bytes += impl->resumed_from;
      slot.up = NodeSlot::Up::Uploading;
      slot.session = impl->session = next_session_++;
      spdlog::info("round {}: node {} resumes its upload at byte {} of {} (sends from {})", round,
                   node.node_id, impl->resumed_from, total_bytes, offset);
      return std::unique_ptr<UploadSession>(new UploadSession(std::move(impl)));
    }
    if (slot.accepted_round == round) {
      // Already accepted: a retry whose reply was lost (same incarnation: nothing to do), or
      // a restarted node sending the round again (its first upload counts; it must take the
      // published model). Either way it is never applied twice.
      impl->duplicate = true;
      impl->stale = slot.accepted_incarnation != node.incarnation;
    } else if (round <= published_round_) {
      sync_fail(SyncErrc::OutOfRange, "node {}: round {} is closed (latest published round {}); "
                "an old round's upload is never applied: take the published model and carry on",
                node.node_id, round, published_round_);
    } else if (round != published_round_ + 1) {
      sync_fail(SyncErrc::FailedPrecondition, "node {}: upload for round {} refused: the server "
                "collects round {} (latest published {})", node.node_id, round,
                published_round_ + 1, published_round_);
    } else if (slot.up == NodeSlot::Up::Rejected) {
      sync_fail(SyncErrc::InvalidArgument, "node {}: its upload for round {} was rejected ({}); "
                "it is out of this round: take the published model when the round publishes",
                node.node_id, round, slot.detail);
    } else if (slot.up == NodeSlot::Up::Ready || slot.up == NodeSlot::Up::Folded) {
      impl->duplicate = true;
      impl->stale = slot.accepted_incarnation != node.incarnation;
    } else {
      const uint64_t limit = 8 + kMaxHeaderBytes + model_->plan().upload_data_bytes(node.node_id);
      if (total_bytes < 8 || total_bytes > limit) {
        const std::string why = fmt::format("node {}: an upload of {} bytes is impossible (its "
                                            "tensors take at most {} bytes)", node.node_id,
                                            total_bytes, limit);
        slot.up = NodeSlot::Up::Rejected;
        slot.detail = why;
        spdlog::warn("round {}: upload of node {} rejected, the node is out of this round: {}",
                     round, node.node_id, why);
        maybe_publish(false);
        throw SyncError(SyncErrc::ResourceExhausted, why);
      }
      // An upload still open for this node (a dead connection, a restarted node) is
      // superseded: its finish() will be refused. A kept interrupted one is dropped.
      drop_kept_upload(slot, "the node sends its upload again from the start");
      slot.up = NodeSlot::Up::Uploading;
      slot.session = impl->session = next_session_++;
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
    // One file per stream: a superseded stream still open never shares (or deletes) it.
    s->partial = fmt::format("{}.partial{}", s->path, s->session);
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
    // Values are checked piece by piece as they arrive (memory: one chunk per upload), and
    // their distance from the published model is accumulated for the update-size bound.
    s->reader->set_slice_handler(
        [this, s, origin](const StreamEntry& e, int64_t first, const torch::Tensor& run, bool) {
          check_upload_run(e, run, origin);
          const int64_t i = model_->plan().index(e.name);
          if (i < 0 || run.numel() == 0) return;
          const torch::Tensor pub =
              model_->tensors()[i].view({-1}).slice(0, first, first + run.numel());
          s->diff_sq += (run.to(torch::kFloat32) - pub).pow(2).sum().item<double>();
          s->base_sq += pub.pow(2).sum().item<double>();
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

void RoundState::reject_upload(int64_t node, int64_t round, uint64_t session,
                               const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  auto& slot = nodes_[node];
  if (round != published_round_ + 1 || slot.session != session ||
      slot.up != NodeSlot::Up::Uploading)
    return;
  slot.up = NodeSlot::Up::Rejected;
  slot.detail = why;
  spdlog::warn("round {}: upload of node {} rejected, the node is out of this round: {}", round,
               node, why);
  maybe_publish(false);
}

bool RoundState::is_dead(size_t i) const {
  const auto& n = nodes_[i];
  return n.joined && !n.left && n.seen &&
         seconds_since(n.last_seen) > cfg_.spes_config.heartbeat_timeout;
}

std::string RoundState::node_state(size_t i) const {
  const auto& n = nodes_[i];
  if (n.left) return "left";
  if (!n.joined) return "not_joined";
  if (is_dead(i)) return "dead";
  switch (n.up) {
    case NodeSlot::Up::Uploading: return "uploading";
    case NodeSlot::Up::Ready:
    case NodeSlot::Up::Folded: return "uploaded";
    case NodeSlot::Up::Rejected: return "rejected";
    case NodeSlot::Up::None: break;
  }
  return "training";
}

nlohmann::json RoundState::missing_nodes() const {
  nlohmann::json out = nlohmann::json::array();
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const auto& n = nodes_[i];
    if (n.up == NodeSlot::Up::Ready || n.up == NodeSlot::Up::Folded) continue;
    std::string why = "timeout";
    if (n.up == NodeSlot::Up::Rejected) why = "rejected: " + n.detail;
    else if (n.left) why = "left";
    else if (!n.joined) why = "not_joined";
    else if (is_dead(i)) why = "dead";
    out.push_back({{"node", i}, {"reason", why}});
  }
  return out;
}

void RoundState::fold_ready() {
  const int64_t N = static_cast<int64_t>(nodes_.size());
  while (next_fold_ < N && nodes_[next_fold_].up == NodeSlot::Up::Ready) {
    auto& slot = nodes_[next_fold_];
    fold_upload_file(*agg_, model_->plan(), slot.path, next_fold_);
    slot.up = NodeSlot::Up::Folded;
    ++next_fold_;
  }
  maybe_publish(false);
}

void RoundState::maybe_publish(bool deadline_check) {
  if (closed_) return;
  const int64_t N = static_cast<int64_t>(nodes_.size());
  int64_t present = 0, out = 0;
  for (int64_t i = 0; i < N; ++i) {
    const auto& n = nodes_[i];
    if (n.up == NodeSlot::Up::Ready || n.up == NodeSlot::Up::Folded) ++present;
    else if (n.up == NodeSlot::Up::Rejected || n.left || is_dead(i)) ++out;
  }
  if (present == 0 || present < std::min<int64_t>(cfg_.spes_config.min_nodes, N)) return;
  const bool everyone = present + out == N;
  const bool deadline = deadline_check && round_started_ &&
                        seconds_since(round_start_) >= cfg_.spes_config.round_timeout;
  if (!everyone && !deadline) return;
  if (present < N) {
    // Fold the uploads that arrived, skipping the missing nodes (still ascending order).
    for (int64_t i = next_fold_; i < N; ++i) {
      auto& slot = nodes_[i];
      if (slot.up != NodeSlot::Up::Ready) continue;
      fold_upload_file(*agg_, model_->plan(), slot.path, i);
      slot.up = NodeSlot::Up::Folded;
    }
    next_fold_ = N;
  }
  const nlohmann::json missing = missing_nodes();
  if (!missing.empty())
    spdlog::warn("round {}: publishing with {} of {} nodes{}; missing {}", published_round_ + 1,
                 present, N, deadline && !everyone ? " at its deadline" : "", missing.dump());
  const int64_t round = published_round_ + 1;
  publish();
  if (!opts_.keep_uploads)
    for (int64_t i = 0; i < N; ++i) {
      std::error_code ec;
      fs::remove(staged_path(round, i), ec);
    }
}

void RoundState::publish() {
  ++generation_;
  const auto t0 = Clock::now();
  const nlohmann::json missing = missing_nodes();
  const nlohmann::json node_states = [&] {
    nlohmann::json a = nlohmann::json::array();
    for (size_t i = 0; i < nodes_.size(); ++i) a.push_back(node_state(i));
    return a;
  }();
  const RoundOutcome o = agg_->finish();
  const double aggregate_s = seconds_since(t0);
  const std::string sha = model_->weights_sha256();
  const auto t1 = Clock::now();
  published_round_ = o.round;
  published_step_ = o.step;
  published_alpha_ = o.alpha;
  published_merged_ = o.merged;
  published_nodes_ = o.nodes;
  const int64_t N = static_cast<int64_t>(nodes_.size());
  PendingLine pl;
  pl.round = o.round;
  pl.published_at = Clock::now();
  pl.bytes_out.assign(N, 0);
  // The line waits for the downloads of the nodes whose uploads the round used (a missing
  // node takes the whole model instead, if it ever comes back).
  pl.downloaded.assign(N, true);
  for (int64_t n : o.nodes) pl.downloaded[n] = false;
  std::vector<uint64_t> bytes_in(N), wire_in(N), resumed_in(N);
  uint64_t total_in = 0;
  for (int64_t i = 0; i < N; ++i) {
    bytes_in[i] = nodes_[i].bytes_in;
    total_in += bytes_in[i];
    wire_in[i] = nodes_[i].wire_bytes;
    resumed_in[i] = nodes_[i].resumed_bytes;
    nodes_[i].up = NodeSlot::Up::None;
    nodes_[i].bytes_in = nodes_[i].wire_bytes = nodes_[i].resumed_bytes = 0;
    drop_kept_upload(nodes_[i], "the round was published");
  }
  const double seconds = round_started_ ? seconds_since(round_start_) : 0.0;
  for (int64_t i = 0; i < N; ++i) nodes_[i].detail.clear();
  pl.line = {{"round", o.round},
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
             {"seconds", seconds},
             {"aggregate_s", aggregate_s},
             {"model_sha256", sha},
             {"node_states", node_states},
             {"missing", missing}};
  if (o.merged) pl.line["gate_cos_before"] = o.gate_cos_before;
  // Persisted before anyone can see the round: a crash now loses nothing, and a restarted
  // server continues from here (the line is kept in state.json for rounds.jsonl).
  persist(sha, pl.line);
  published_sha_ = sha;
  const double persist_s = seconds_since(t1);
  pl.line["persist_s"] = persist_s;
  remember_round(pl.line);
  // Lines stay in round order: an older round still waiting for downloads is written now.
  for (auto& old : pending_) write_line(old);
  pending_.clear();
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

void RoundState::persist(const std::string& sha, const nlohmann::json& line) {
  const std::string dir = opts_.out_dir;
  const bool diloco = cfg_.spes_config.mode == "diloco";
  // Order: momentum of the round, then the published model (authoritative on restart), then
  // state.json; each written to a temporary name, fsynced and renamed.
  if (diloco)
    write_stream_file(fmt::format("{}/momentum-{}.safetensors", dir, published_round_),
                      SafetensorsStreamWriter(model_->momentum_named(), torch::kFloat32,
                                              {{"format", "spes-momentum-v1"},
                                               {"round", std::to_string(published_round_)}}));
  write_stream_file(published_path(),
                    published_writer(*model_, published_round_, published_step_, sha));
  const nlohmann::json st = {{"format", "spes-server-state-v1"},
                             {"round", published_round_},
                             {"step", published_step_},
                             {"model_sha256", sha},
                             {"alpha", published_alpha_},
                             {"merged", published_merged_},
                             {"nodes", published_nodes_},
                             {"mode", cfg_.spes_config.mode},
                             {"model_fingerprint", model_->model_fingerprint()},
                             {"ownership_fingerprint", model_->ownership_fingerprint()},
                             {"server_incarnation", incarnation_},
                             {"line", line},
                             {"time", unix_time()}};
  file_write_atomic(dir + "/state.json", st.dump(2));
  if (diloco && published_round_ > 1) {
    std::error_code ec;
    fs::remove(fmt::format("{}/momentum-{}.safetensors", dir, published_round_ - 1), ec);
  }
  if (opts_.keep_uploads) {
    const std::string rdir = fmt::format("{}/rounds/{}", dir, published_round_);
    fs::create_directories(rdir);
    auto keep = [&](const std::string& name, const std::string& as) {
      std::error_code ec;
      fs::remove(rdir + "/" + as, ec);
      fs::create_hard_link(dir + "/" + name, rdir + "/" + as, ec);
      if (ec) fs::copy_file(dir + "/" + name, rdir + "/" + as);
    };
    keep("published.safetensors", "published.safetensors");
    if (diloco && published_round_ > 0)
      keep(fmt::format("momentum-{}.safetensors", published_round_), "momentum.safetensors");
  }
}

RoundStatus RoundState::wait_round(const NodeId& node, int64_t round, uint32_t max_wait_ms) {
  std::unique_lock<std::mutex> lk(mu_);
  check_node(node);
  const auto deadline =
      Clock::now() + std::chrono::milliseconds(std::min<uint32_t>(max_wait_ms, kMaxWaitMs));
  // Returns at once when the server does not hold (and is not receiving) the caller's upload
  // for the round it waits for: after a server restart, the node must send it again.
  const auto& me = nodes_[node.node_id];
  cv_.wait_until(lk, deadline, [&] {
    return published_round_ >= round || closed_ ||
           (round == published_round_ + 1 && me.up == NodeSlot::Up::None);
  });
  RoundStatus r;
  r.round = round;
  r.published_round = published_round_;
  r.step = round * cfg_.spes_config.sync_steps;
  r.published = published_round_ >= round;
  r.published_step = published_step_;
  if (r.published && round == published_round_) {
    r.model_sha256 = published_sha_;
    r.alpha = published_alpha_;
    r.nodes = published_nodes_;
    r.download_bytes = download_writer(node.node_id, round, Selection::ForNode)->total_bytes();
  }
  if (!r.published && round == published_round_ + 1)
    for (size_t i = 0; i < nodes_.size(); ++i)
      if (nodes_[i].up != NodeSlot::Up::Ready && nodes_[i].up != NodeSlot::Up::Folded)
        r.waiting_for.push_back(static_cast<int64_t>(i));
  return r;
}

std::unique_ptr<DownloadSession> RoundState::begin_download(const NodeId& node, int64_t round,
                                                            Selection selection,
                                                            uint64_t offset) {
  std::lock_guard<std::mutex> lk(mu_);
  check_node(node);
  if (round > published_round_)
    sync_fail(SyncErrc::FailedPrecondition, "node {}: round {} is not published yet (latest "
              "published round {})", node.node_id, round, published_round_);
  if (round < published_round_)
    sync_fail(SyncErrc::OutOfRange, "node {}: round {} is no longer available; the latest "
              "published round is {}: take that one", node.node_id, round, published_round_);
  auto impl = std::make_unique<DownloadSession::Impl>();
  impl->st = this;
  impl->node = node.node_id;
  impl->round = round;
  impl->selection = selection;
  impl->writer = download_writer(node.node_id, round, selection);
  if (offset > impl->writer->total_bytes())
    sync_fail(SyncErrc::OutOfRange, "node {}: download offset {} is past the end of round {}'s "
              "{} byte stream", node.node_id, offset, round, impl->writer->total_bytes());
  impl->offset = impl->start = offset;
  return std::unique_ptr<DownloadSession>(new DownloadSession(std::move(impl)));
}

std::unique_ptr<SafetensorsStreamWriter> RoundState::download_writer(int64_t node, int64_t round,
                                                                     Selection selection) const {
  const RoundPlan& plan = model_->plan();
  std::vector<size_t> idx;
  if (selection == Selection::All || round == 0) {
    for (size_t i = 0; i < plan.tensors().size(); ++i) idx.push_back(i);
  } else {
    // A node whose upload the round did not use gets its own experts back too.
    const bool used = std::find(published_nodes_.begin(), published_nodes_.end(), node) !=
                      published_nodes_.end();
    idx = plan.download_for(node, published_merged_ || !used);
  }
  std::vector<std::string> names;
  for (size_t i : idx) names.push_back(plan.tensors()[i].name);
  // Served from the persisted file, not from memory: the bytes of this round stay valid
  // whatever is published next, and cost no memory beyond one chunk.
  return std::make_unique<SafetensorsStreamWriter>(SafetensorsStreamWriter::from_file(
      published_path(), names, wire_scalar_type(plan.wire()),
      Metadata{{"format", "spes-download-v1"},
               {"round", std::to_string(round)},
               {"step", std::to_string(published_step_)},
               {"model_sha256", published_sha_},
               {"selection", selection == Selection::All ? "all" : "for_node"}}));
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
  remember_round(pl.line);  // now with its download figures
  const std::string s = pl.line.dump() + "\n";
  std::fwrite(s.data(), 1, s.size(), rounds_log_);
  std::fflush(rounds_log_);
}

void RoundState::leave(const NodeId& node, int64_t step, const std::string& reason) {
  std::lock_guard<std::mutex> lk(mu_);
  check_node(node);
  nodes_[node.node_id].left = true;
  nodes_[node.node_id].step = step;
  spdlog::info("node {} left at step {}{}{}", node.node_id, step, reason.empty() ? "" : ": ",
               reason);
  maybe_publish(false);  // the round no longer waits for it
}

int64_t RoundState::heartbeat(const NodeId& node, int64_t step, const NodeMetrics& m) {
  std::lock_guard<std::mutex> lk(mu_);
  check_node(node);
  NodeSlot& slot = nodes_[node.node_id];
  slot.step = step;
  if (std::isfinite(m.loss)) slot.loss = m.loss;
  if (std::isfinite(m.tokens_per_s)) slot.tokens_per_s = m.tokens_per_s;
  for (const LossPoint& p : m.losses) slot.losses.add(p.step, p.loss);
  return published_round_;
}

void RoundState::remember_round(const nlohmann::json& line) {
  const int64_t round = line.value("round", int64_t{-1});
  // Replaces the record of the same round (its line now has the download figures).
  for (auto it = history_.rbegin(); it != history_.rend(); ++it)
    if (it->value("round", int64_t{-1}) == round) {
      *it = line;
      return;
    }
  history_.push_back(line);
  while (history_.size() > kRoundHistory) history_.pop_front();
}

std::vector<nlohmann::json> RoundState::round_history() const {
  std::lock_guard<std::mutex> lk(mu_);
  return {history_.begin(), history_.end()};
}

std::vector<std::vector<LossPoint>> RoundState::loss_history() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<std::vector<LossPoint>> out;
  for (const auto& n : nodes_) out.push_back(n.losses.points());
  return out;
}

ServerStatus RoundState::status() const {
  std::lock_guard<std::mutex> lk(mu_);
  ServerStatus st;
  st.published_round = published_round_;
  st.published_step = published_step_;
  st.collecting_round = published_round_ + 1;
  st.model_sha256 = published_sha_;
  st.round_open_s = round_started_ ? seconds_since(round_start_) : 0.0;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    NodeState n;
    n.node_id = static_cast<int64_t>(i);
    n.state = node_state(i);
    n.step = nodes_[i].step;
    n.last_seen_s = nodes_[i].seen ? seconds_since(nodes_[i].last_seen) : -1.0;
    n.detail = nodes_[i].detail;
    n.loss = nodes_[i].loss;
    n.tokens_per_s = nodes_[i].tokens_per_s;
    st.nodes.push_back(n);
  }
  return st;
}

void RoundState::tick() {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const bool dead = is_dead(i);
    if (!dead) nodes_[i].dead_logged = false;
    if (dead && !nodes_[i].dead_logged) {
      nodes_[i].dead_logged = true;
      spdlog::warn("node {} is dead: nothing heard from it for {:.0f} s "
                   "(spes_config.heartbeat_timeout)", i, seconds_since(nodes_[i].last_seen));
    }
  }
  maybe_publish(true);
  if (!round_started_ || seconds_since(last_wait_log_) < opts_.wait_log_s) return;
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
