// gRPC client of the sync protocol (see client.h).
#include "spes/sync/node/client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <thread>
#include <utility>

#include <spdlog/spdlog.h>

#include "spes/io/files.h"
#include "spes/sync/wire/auth.h"
#include "spes/sync/wire/checksum.h"
#include "spes/sync/wire/chunk_coding.h"
#include "spes/sync/wire/ownership_message.h"
#include "spes_sync.grpc.pb.h"

namespace spes::sync {
namespace pb = ::spes::sync::v1;

namespace {

SyncErrc errc_of(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::INVALID_ARGUMENT: return SyncErrc::InvalidArgument;
    case grpc::StatusCode::FAILED_PRECONDITION: return SyncErrc::FailedPrecondition;
    case grpc::StatusCode::DATA_LOSS: return SyncErrc::DataLoss;
    case grpc::StatusCode::ABORTED: return SyncErrc::Aborted;
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return SyncErrc::ResourceExhausted;
    case grpc::StatusCode::UNAVAILABLE: return SyncErrc::Unavailable;
    case grpc::StatusCode::DEADLINE_EXCEEDED: return SyncErrc::DeadlineExceeded;
    case grpc::StatusCode::OUT_OF_RANGE: return SyncErrc::OutOfRange;
    case grpc::StatusCode::NOT_FOUND: return SyncErrc::NotJoined;
    case grpc::StatusCode::PERMISSION_DENIED: return SyncErrc::PermissionDenied;
    case grpc::StatusCode::UNAUTHENTICATED: return SyncErrc::PermissionDenied;
    // The server ends a stream (CANCELLED to the client) when a newer stream of the same node
    // supersedes it or it sat idle too long: like ABORTED, worth a retry.
    case grpc::StatusCode::CANCELLED: return SyncErrc::Aborted;
    default: return SyncErrc::Internal;
  }
}

void check(const grpc::Status& s, const char* rpc, const std::string& address) {
  if (s.ok()) return;
  // The server's thread cap refused the call (a flood of calls, maybe from someone else):
  // transient, unlike the server's own RESOURCE_EXHAUSTED refusals of oversized uploads.
  if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
      s.error_message() == "Server Threadpool Exhausted")
    throw SyncError(SyncErrc::Unavailable, fmt::format("{} to sync server {}: the server is "
                    "busy (thread cap reached); retrying", rpc, address));
  throw SyncError(errc_of(s.error_code()),
                  fmt::format("{} to sync server {}: {}", rpc, address, s.error_message()));
}

void set_deadline(grpc::ClientContext& ctx, double seconds) {
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
}

// Every call: its deadline and the node's credentials as metadata (never in a message body).
void prepare(grpc::ClientContext& ctx, const NodeId& id, double seconds) {
  set_deadline(ctx, seconds);
  ctx.AddMetadata(kNodeIdMetadata, std::to_string(id.node_id));
  if (!id.auth_token.empty()) ctx.AddMetadata(kNodeTokenMetadata, id.auth_token);
}

}  // namespace

struct SyncClient::Impl {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::SpesSync::Stub> stub;
};

SyncClient::SyncClient(const std::string& address, NodeId id, const ClientTls& tls)
    : impl_(std::make_unique<Impl>()), id_(std::move(id)) {
  impl_->address = address;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // A restarted server is found within a second of listening (a refused connection on a
  // dead port costs nothing; waits for it go through wait_connected, which tries at once).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  SPES_CHECK(tls.cert_pem.empty() || !tls.root_pem.empty(), "spes_config.tls_client_cert is set "
             "but tls_ca is not: without tls_ca the connection would be plaintext and the "
             "certificate unused; set spes_config.tls_ca to the PEM roots of the server's "
             "certificate");
  SPES_CHECK(!tls.root_pem.empty() || tls.insecure || is_loopback_host(address), "refusing a "
             "plaintext connection to sync server '{}', which is not on loopback: a listener "
             "could take the node's token and a man in the middle could change the model. Set "
             "spes_config.tls_ca (the server needs tls_cert/tls_key), or pass --insecure to "
             "accept that risk", address);
  if (tls.root_pem.empty() && !is_loopback_host(address))
    spdlog::warn("--insecure: plaintext connection to sync server {}: its token and the model "
                 "cross the network unprotected", address);
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!tls.root_pem.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = tls.root_pem;
    ssl.pem_cert_chain = tls.cert_pem;
    ssl.pem_private_key = tls.key_pem;
    creds = grpc::SslCredentials(ssl);
  }
  impl_->channel = grpc::CreateCustomChannel(address, creds, args);
  impl_->stub = pb::SpesSync::NewStub(impl_->channel);
}

SyncClient::~SyncClient() = default;

bool SyncClient::wait_connected(double timeout_s) {
  grpc::experimental::ChannelResetConnectionBackoff(impl_->channel.get());
  return impl_->channel->WaitForConnected(
      std::chrono::system_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
}

void SyncClient::wait_before_retry(double backoff_s) {
  if (impl_->channel->GetState(/*try_to_connect=*/false) != GRPC_CHANNEL_READY) {
    wait_connected(backoff_s);
    return;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(backoff_s * 1000)));
}

static void fill(pb::NodeIdentity* n, const NodeId& id) {
  n->set_node_id(id.node_id);
  n->set_incarnation(id.incarnation);
}

// The fields every chunk of an upload stream (and a resume query) carries.
static pb::UploadChunk upload_chunk(const NodeId& id, int64_t round, int64_t step,
                                    uint64_t total_bytes) {
  pb::UploadChunk c;
  fill(c.mutable_node(), id);
  c.set_round(round);
  c.set_step(step);
  c.set_total_bytes(total_bytes);
  return c;
}

JoinResult SyncClient::join(const JoinInfo& info) {
  pb::JoinRequest req;
  fill(req.mutable_node(), info.node);
  req.set_protocol_version(info.protocol_version);
  req.mutable_settings()->insert(info.settings.begin(), info.settings.end());
  req.set_step(info.step);
  req.set_ownership_epoch(info.ownership_epoch);
  req.set_held_ownership_fingerprint(info.ownership_fingerprint);
  req.set_expert_capacity(info.expert_capacity);
  req.set_memory_capacity_gib(info.memory_capacity_gib);
  req.set_precision(info.precision);
  pb::JoinReply rep;
  grpc::ClientContext ctx;
  prepare(ctx, info.node, 60);
  check(impl_->stub->Join(&ctx, req, &rep), "Join", impl_->address);
  JoinResult r;
  r.server_incarnation = rep.server_incarnation();
  r.published_round = rep.published_round();
  r.published_step = rep.published_step();
  r.model_sha256 = rep.model_sha256();
  r.max_chunk_bytes = rep.max_chunk_bytes();
  r.heartbeat_interval_ms = rep.heartbeat_interval_ms();
  r.published_nodes.assign(rep.published_nodes().begin(), rep.published_nodes().end());
  r.ownership = ownership_from_message(rep.ownership());
  return r;
}

uint64_t SyncClient::resume_offset(int64_t round, int64_t step, uint64_t total_bytes) {
  grpc::ClientContext ctx;
  prepare(ctx, id_, 60);
  pb::UploadReply rep;
  std::unique_ptr<grpc::ClientWriter<pb::UploadChunk>> w(impl_->stub->Upload(&ctx, &rep));
  pb::UploadChunk c = upload_chunk(id_, round, step, total_bytes);
  c.set_resume_query(true);
  w->Write(c);
  w->WritesDone();
  check(w->Finish(), "Upload (resume query)", impl_->address);
  if (rep.resume_offset() > total_bytes)
    sync_fail(SyncErrc::DataLoss, "sync server {} says it holds {} bytes of a {} byte upload",
              impl_->address, rep.resume_offset(), total_bytes);
  return rep.resume_offset();
}

UploadResult SyncClient::upload(int64_t round, int64_t step,
                                const SafetensorsStreamWriter& payload) {
  const uint64_t total = payload.total_bytes();
  const bool retry = attempted_.round == round && attempted_.step == step &&
                     attempted_.total == total;
  if (!retry) attempted_ = {round, step, total, 0};
  // A retry resumes where an interrupted stream stopped, if the server kept its bytes.
  const uint64_t start = retry ? resume_offset(round, step, total) : 0;
  if (start > 0)
    spdlog::info("node {}: resuming the round {} upload at byte {} of {}", id_.node_id, round,
                 start, total);
  const uint64_t chunk_bytes = filter_ ? filter_->open_stream(round, total) : kChunkBytes;
  // The whole stream's checksum goes with the last chunk; the part not sent again is read here.
  StreamChecksum whole;
  std::string data;
  for (uint64_t off = 0; off < start; off += chunk_bytes) {
    data.clear();
    payload.read(off, std::min(chunk_bytes, start - off), &data);
    whole.update(data.data(), data.size());
  }
  grpc::ClientContext ctx;
  prepare(ctx, id_, 3600);
  pb::UploadReply rep;
  std::unique_ptr<grpc::ClientWriter<pb::UploadChunk>> w(impl_->stub->Upload(&ctx, &rep));
  pb::UploadChunk c = upload_chunk(id_, round, step, total);
  // Sends one chunk (its bytes lent to the message and given back); false: the server ended
  // the stream, and Finish() says why.
  std::string packed;
  const std::function<bool(OutgoingChunk&)> send = [&](OutgoingChunk& o) {
    c.set_offset(o.offset);
    c.set_checksum(o.checksum);
    if (o.upload_checksum.empty()) c.clear_upload_checksum();
    else c.set_upload_checksum(o.upload_checksum);
    const ChunkEncoding enc = zstd_ ? pack_chunk(o.data, &packed) : ChunkEncoding::Raw;
    c.set_encoding(static_cast<uint32_t>(enc));
    std::string& bytes = enc == ChunkEncoding::Raw ? o.data : packed;
    const size_t n = bytes.size();
    c.set_data(std::move(bytes));
    const bool ok = w->Write(c);
    bytes = std::move(*c.mutable_data());
    if (ok) attempted_.sent += n;
    return ok;
  };
  OutgoingChunk chunk;
  for (uint64_t off = start; off < total; off += chunk_bytes) {
    chunk.data.clear();
    payload.read(off, chunk_bytes, &chunk.data);
    whole.update(chunk.data.data(), chunk.data.size());
    chunk.offset = off;
    chunk.checksum = chunk_checksum(chunk.data);
    chunk.upload_checksum = off + chunk.data.size() >= total ? whole.hex_digest() : "";
    if (!(filter_ ? filter_->send(chunk, send) : send(chunk))) break;
  }
  w->WritesDone();
  check(w->Finish(), "Upload", impl_->address);
  UploadResult r;
  r.accepted = rep.accepted();
  r.duplicate = rep.duplicate();
  r.bytes = rep.bytes_received();
  r.checksum = rep.upload_checksum();
  r.resumed_from = start;
  r.bytes_sent = attempted_.sent;
  return r;
}

RoundStatus SyncClient::wait_round(int64_t round, uint32_t max_wait_ms) {
  pb::WaitRoundRequest req;
  fill(req.mutable_node(), id_);
  req.set_round(round);
  req.set_max_wait_ms(max_wait_ms);
  pb::RoundInfo rep;
  grpc::ClientContext ctx;
  prepare(ctx, id_, max_wait_ms / 1000.0 + 30);
  check(impl_->stub->WaitRound(&ctx, req, &rep), "WaitRound", impl_->address);
  RoundStatus r;
  r.round = rep.round();
  r.published = rep.published();
  r.step = rep.step();
  r.model_sha256 = rep.model_sha256();
  r.alpha = rep.alpha();
  r.download_bytes = rep.download_bytes();
  r.waiting_for.assign(rep.waiting_for().begin(), rep.waiting_for().end());
  r.published_round = rep.published_round();
  r.published_step = rep.published_step();
  r.nodes.assign(rep.nodes().begin(), rep.nodes().end());
  r.ownership = ownership_from_message(rep.ownership());
  return r;
}

uint64_t SyncClient::download(int64_t round, Selection selection,
                              const std::function<void(uint64_t)>& on_begin,
                              const std::function<void(const char*, size_t)>& on_data,
                              uint64_t offset, int64_t from_round) {
  pb::DownloadRequest req;
  fill(req.mutable_node(), id_);
  req.set_round(round);
  req.set_offset(offset);
  if (from_round >= 0) req.set_from_round(from_round);
  req.set_selection(selection == Selection::All ? pb::SELECTION_ALL : pb::SELECTION_FOR_NODE);
  req.set_accept_zstd(zstd_);
  grpc::ClientContext ctx;
  prepare(ctx, id_, 3600);
  std::unique_ptr<grpc::ClientReader<pb::DownloadChunk>> rd(impl_->stub->Download(&ctx, req));
  pb::DownloadChunk c;
  std::string raw;
  uint64_t received = offset, total = 0;
  bool begun = false;
  try {
    while (rd->Read(&c)) {
      if (!begun) {
        total = c.total_bytes();
        on_begin(total);
        begun = true;
      }
      if (c.round() != round || c.total_bytes() != total || c.offset() != received)
        sync_fail(SyncErrc::DataLoss, "download of round {}: chunk for round {} at offset {} "
                  "(expected offset {} of {})", round, c.round(), c.offset(), received, total);
      if (c.data().size() > kMaxChunkBytes)
        sync_fail(SyncErrc::ResourceExhausted, "download chunk of {} bytes exceeds {}",
                  c.data().size(), kMaxChunkBytes);
      download_wire_bytes_ += c.data().size();
      if (c.encoding() != static_cast<uint32_t>(ChunkEncoding::Raw) && !zstd_)
        sync_fail(SyncErrc::DataLoss, "download of round {}: the server sent a coded chunk "
                  "(encoding {}) that this download did not ask for", round, c.encoding());
      const std::string_view data = unpack_chunk(
          c.encoding(), c.data(), kMaxChunkBytes, &raw,
          fmt::format("download of round {}, chunk at offset {}", round, c.offset()));
      if (chunk_checksum(data) != c.checksum())
        sync_fail(SyncErrc::DataLoss, "download of round {}: checksum mismatch in the chunk at "
                  "offset {}", round, c.offset());
      on_data(data.data(), data.size());
      received += data.size();
    }
  } catch (...) {
    ctx.TryCancel();
    rd->Finish();
    throw;
  }
  check(rd->Finish(), "Download", impl_->address);
  if (!begun || received != total)
    sync_fail(SyncErrc::DataLoss, "download of round {} ended after {} of {} bytes", round,
              received, total);
  return received - offset;
}

int64_t SyncClient::hand_over(const SafetensorsStreamWriter& payload) {
  const uint64_t total = payload.total_bytes();
  grpc::ClientContext ctx;
  prepare(ctx, id_, 3600);
  pb::HandOverReply rep;
  std::unique_ptr<grpc::ClientWriter<pb::MomentsChunk>> w(impl_->stub->HandOver(&ctx, &rep));
  pb::MomentsChunk c;
  fill(c.mutable_node(), id_);
  c.set_total_bytes(total);
  StreamChecksum whole;
  std::string data;
  for (uint64_t off = 0; off < total; off += kChunkBytes) {
    data.clear();
    payload.read(off, kChunkBytes, &data);
    whole.update(data.data(), data.size());
    c.set_offset(off);
    c.set_checksum(chunk_checksum(data));
    if (off + data.size() >= total) c.set_stream_checksum(whole.hex_digest());
    c.set_data(data);
    if (!w->Write(c)) break;  // the server ended the stream: Finish() says why
  }
  w->WritesDone();
  check(w->Finish(), "HandOver", impl_->address);
  return rep.experts();
}

std::string SyncClient::fetch_moments(int64_t epoch, uint64_t max_bytes) {
  pb::FetchMomentsRequest req;
  fill(req.mutable_node(), id_);
  req.set_ownership_epoch(epoch);
  grpc::ClientContext ctx;
  prepare(ctx, id_, 3600);
  std::unique_ptr<grpc::ClientReader<pb::DownloadChunk>> rd(
      impl_->stub->FetchMoments(&ctx, req));
  pb::DownloadChunk c;
  std::string out;
  uint64_t total = 0;
  try {
    while (rd->Read(&c)) {
      if (out.empty()) total = c.total_bytes();
      if (total > max_bytes)
        sync_fail(SyncErrc::ResourceExhausted, "moments of epoch {}: the server sends {} bytes, "
                  "more than the experts this node gains can need ({})", epoch, total, max_bytes);
      if (c.total_bytes() != total || c.offset() != out.size() ||
          c.data().size() > kMaxChunkBytes || out.size() + c.data().size() > total)
        sync_fail(SyncErrc::DataLoss, "moments of epoch {}: chunk at offset {} (expected {} of "
                  "{})", epoch, c.offset(), out.size(), total);
      if (chunk_checksum(c.data()) != c.checksum())
        sync_fail(SyncErrc::DataLoss, "moments of epoch {}: checksum mismatch in the chunk at "
                  "offset {}", epoch, c.offset());
      out += c.data();
    }
  } catch (...) {
    ctx.TryCancel();
    rd->Finish();
    throw;
  }
  check(rd->Finish(), "FetchMoments", impl_->address);
  if (out.empty() || out.size() != total)
    sync_fail(SyncErrc::DataLoss, "moments of epoch {} ended after {} of {} bytes", epoch,
              out.size(), total);
  return out;
}

int64_t SyncClient::heartbeat(int64_t step, const NodeMetrics& metrics) {
  pb::HeartbeatRequest req;
  fill(req.mutable_node(), id_);
  req.set_step(step);
  if (std::isfinite(metrics.loss)) req.set_loss(metrics.loss);
  if (std::isfinite(metrics.tokens_per_s)) req.set_tokens_per_s(metrics.tokens_per_s);
  for (const LossPoint& p : metrics.losses) {
    pb::LossPoint* q = req.add_losses();
    q->set_step(p.step);
    q->set_loss(p.loss);
  }
  pb::HeartbeatReply rep;
  grpc::ClientContext ctx;
  prepare(ctx, id_, 10);
  check(impl_->stub->Heartbeat(&ctx, req, &rep), "Heartbeat", impl_->address);
  return rep.published_round();
}

ServerStatus SyncClient::status(const std::string& read_token) {
  pb::StatusRequest req;
  pb::StatusReply rep;
  grpc::ClientContext ctx;
  set_deadline(ctx, 10);
  if (!read_token.empty()) ctx.AddMetadata(kReadTokenMetadata, read_token);
  check(impl_->stub->Status(&ctx, req, &rep), "Status", impl_->address);
  ServerStatus s;
  s.published_round = rep.published_round();
  s.published_step = rep.published_step();
  s.collecting_round = rep.collecting_round();
  s.model_sha256 = rep.model_sha256();
  s.round_open_s = rep.round_open_s();
  s.protocol_version = rep.protocol_version();
  s.publish_error = rep.publish_error();
  s.ownership_epoch = rep.ownership_epoch();
  s.departed.assign(rep.departed().begin(), rep.departed().end());
  s.frozen_experts.assign(rep.frozen_experts().begin(), rep.frozen_experts().end());
  for (const auto& n : rep.nodes())
    s.nodes.push_back({n.node_id(), n.state(), n.step(), n.last_seen_s(), n.detail(),
                       n.has_loss() ? n.loss() : NAN,
                       n.has_tokens_per_s() ? n.tokens_per_s() : NAN});
  return s;
}

void SyncClient::leave(int64_t step, const std::string& reason, LeaveKind kind) {
  pb::LeaveRequest req;
  fill(req.mutable_node(), id_);
  req.set_step(step);
  req.set_reason(reason);
  req.set_kind(kind == LeaveKind::Departing ? pb::LEAVE_DEPARTING : pb::LEAVE_FINISHED);
  pb::LeaveReply rep;
  grpc::ClientContext ctx;
  prepare(ctx, id_, 30);
  check(impl_->stub->Leave(&ctx, req, &rep), "Leave", impl_->address);
}

}  // namespace spes::sync
