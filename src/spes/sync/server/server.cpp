// gRPC glue of the sync server (see server.h): each RPC checks the caller's credentials from
// its metadata (call_auth.h) before it reads anything, then maps onto one RoundState call;
// streams take their node's slot and are watched for idleness (stream_limits.h), long-polls
// are limited per node (long_poll_limits.h); SyncError codes map onto gRPC status codes, and
// refusals are logged without flooding the log (log_throttle.h).
#include "spes/sync/server/server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/resource_quota.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <thread>

#include "spes/dashboard/dashboard_server.h"
#include "spes/io/files.h"
#include "spes/io/run_layout.h"
#include "spes/common/strings.h"
#include "spes/sync/server/call_auth.h"
#include "spes/sync/server/dashboard_status.h"
#include "spes/sync/server/log_throttle.h"
#include "spes/sync/server/long_poll_limits.h"
#include "spes/sync/server/stream_limits.h"
#include "spes/sync/wire/auth.h"
#include "spes_sync.grpc.pb.h"

namespace spes::sync {
namespace pb = ::spes::sync::v1;

namespace {

constexpr int kMaxStreamsPerConnection = 64;  // an honest node has at most 4 calls open
constexpr int kMaxMetadataBytes = 16 << 10;
constexpr size_t kLongPollsPerNode = 2;  // an honest node has one WaitRound open at a time

grpc::StatusCode grpc_code(SyncErrc c) {
  switch (c) {
    case SyncErrc::InvalidArgument: return grpc::StatusCode::INVALID_ARGUMENT;
    case SyncErrc::FailedPrecondition: return grpc::StatusCode::FAILED_PRECONDITION;
    case SyncErrc::DataLoss: return grpc::StatusCode::DATA_LOSS;
    case SyncErrc::Aborted: return grpc::StatusCode::ABORTED;
    case SyncErrc::ResourceExhausted: return grpc::StatusCode::RESOURCE_EXHAUSTED;
    case SyncErrc::Unavailable: return grpc::StatusCode::UNAVAILABLE;
    case SyncErrc::DeadlineExceeded: return grpc::StatusCode::DEADLINE_EXCEEDED;
    case SyncErrc::OutOfRange: return grpc::StatusCode::OUT_OF_RANGE;
    case SyncErrc::NotJoined: return grpc::StatusCode::NOT_FOUND;
    case SyncErrc::PermissionDenied: return grpc::StatusCode::PERMISSION_DENIED;
    case SyncErrc::Internal: return grpc::StatusCode::INTERNAL;
  }
  return grpc::StatusCode::INTERNAL;
}


class Service final : public pb::SpesSync::Service {
 public:
  Service(RoundState& st, const CallAuth& auth, StreamLimits& limits, LongPollLimits& polls)
      : st_(st), auth_(auth), limits_(limits), polls_(polls) {}

  // Logs the counts of refusals held back by the throttle (called periodically).
  void flush_refusal_logs() {
    for (const std::string& line : refusals_.flush()) spdlog::warn("{}", line);
  }

  grpc::Status Join(grpc::ServerContext* ctx, const pb::JoinRequest* req,
                    pb::JoinReply* rep) override {
    return guarded("Join", *ctx, [&] {
      JoinInfo j;
      j.node = caller(*ctx, req->node());
      j.protocol_version = req->protocol_version();
      j.model_fingerprint = req->model_fingerprint();
      j.ownership_fingerprint = req->ownership_fingerprint();
      j.model_config_sha256 = req->model_config_sha256();
      j.mode = req->mode();
      j.num_peers = req->num_peers();
      j.sync_steps = req->sync_steps();
      j.transfer_dtype = req->transfer_dtype();
      j.compression = req->compression().empty() ? "none" : req->compression();
      j.step = req->step();
      const JoinResult r = st_.join(j);
      rep->set_server_incarnation(r.server_incarnation);
      rep->set_published_round(r.published_round);
      rep->set_published_step(r.published_step);
      rep->set_model_sha256(r.model_sha256);
      rep->set_max_chunk_bytes(r.max_chunk_bytes);
      rep->set_heartbeat_interval_ms(r.heartbeat_interval_ms);
      for (int64_t n : r.published_nodes) rep->add_published_nodes(n);
    });
  }

  grpc::Status Upload(grpc::ServerContext* ctx, grpc::ServerReader<pb::UploadChunk>* reader,
                      pb::UploadReply* rep) override {
    return guarded("Upload", *ctx, [&] {
      // Credentials first: a stranger's stream ends here, before any of its bytes are read.
      const NodeId who = auth_.node(*ctx);
      const auto lease =
          limits_.open(who.node_id, StreamKind::Upload, [ctx] { ctx->TryCancel(); });
      pb::UploadChunk c;
      const auto read = [&] {
        lease->waiting();
        const bool got = reader->Read(&c);
        lease->received();
        if (!got) stream_end_reason(*lease, who.node_id, "upload");
        return got;
      };
      if (!read()) sync_fail(SyncErrc::InvalidArgument, "empty upload stream");
      const NodeId node = caller(*ctx, c.node());
      const int64_t round = c.round(), step = c.step();
      const uint64_t total = c.total_bytes();
      if (c.resume_query()) {
        // "How much of this upload do you hold?": answered at once, no data in this stream.
        rep->set_resume_offset(st_.upload_resume_offset(node, round, step, total));
        return;
      }
      std::unique_ptr<UploadSession> s = st_.begin_upload(node, round, step, total, c.offset());
      std::string whole_sha256;
      do {
        if (c.node().node_id() != node.node_id || c.round() != round ||
            c.total_bytes() != total || c.resume_query())
          sync_fail(SyncErrc::InvalidArgument, "upload chunks disagree on node, round or size");
        if (!c.upload_sha256().empty()) whole_sha256 = c.upload_sha256();
        s->chunk(c.offset(), c.data(), c.sha256());
      } while (read());
      const UploadResult r = s->finish(whole_sha256);
      rep->set_accepted(r.accepted);
      rep->set_bytes_received(r.bytes);
      rep->set_upload_sha256(r.sha256);
      rep->set_duplicate(r.duplicate);
    });
  }

  grpc::Status WaitRound(grpc::ServerContext* ctx, const pb::WaitRoundRequest* req,
                         pb::RoundInfo* rep) override {
    return guarded("WaitRound", *ctx, [&] {
      const NodeId node = caller(*ctx, req->node());
      // At most a few long-polls per node: a newer one ends the oldest early. A wait also ends
      // when its caller goes away (checked on every tick).
      const auto lease = polls_.open(node.node_id, [this] { st_.wake_waiters(); });
      const RoundStatus r =
          st_.wait_round(node, req->round(), req->max_wait_ms(),
                         [&] { return lease->ended_early() || ctx->IsCancelled(); });
      rep->set_round(r.round);
      rep->set_published(r.published);
      rep->set_step(r.step);
      rep->set_model_sha256(r.model_sha256);
      rep->set_alpha(r.alpha);
      rep->set_download_bytes(r.download_bytes);
      for (int64_t n : r.waiting_for) rep->add_waiting_for(n);
      rep->set_published_round(r.published_round);
      rep->set_published_step(r.published_step);
      for (int64_t n : r.nodes) rep->add_nodes(n);
    });
  }

  grpc::Status Download(grpc::ServerContext* ctx, const pb::DownloadRequest* req,
                        grpc::ServerWriter<pb::DownloadChunk>* writer) override {
    return guarded("Download", *ctx, [&] {
      const Selection sel =
          req->selection() == pb::SELECTION_ALL ? Selection::All : Selection::ForNode;
      const NodeId node = caller(*ctx, req->node());
      // One download per node: a newer one ends this one (and this one ends an older one).
      const auto lease =
          limits_.open(node.node_id, StreamKind::Download, [ctx] { ctx->TryCancel(); });
      std::unique_ptr<DownloadSession> s = st_.begin_download(node, req->round(), sel,
                                                              req->offset());
      pb::DownloadChunk c;
      std::string data;
      uint64_t offset = 0;
      while (s->next(&data, &offset)) {
        if (ctx->IsCancelled()) stream_end_reason(*lease, node.node_id, "download");
        c.set_round(s->round());
        c.set_offset(offset);
        c.set_total_bytes(s->total_bytes());
        c.set_sha256(chunk_sha256(data));
        c.set_data(std::move(data));
        if (!writer->Write(c)) stream_end_reason(*lease, node.node_id, "download");
        data = std::move(*c.mutable_data());
      }
    });
  }

  grpc::Status Leave(grpc::ServerContext* ctx, const pb::LeaveRequest* req,
                     pb::LeaveReply*) override {
    return guarded("Leave", *ctx, [&] {
      st_.leave(caller(*ctx, req->node()), req->step(), req->reason());
    });
  }

  grpc::Status Heartbeat(grpc::ServerContext* ctx, const pb::HeartbeatRequest* req,
                         pb::HeartbeatReply* rep) override {
    return guarded("Heartbeat", *ctx, [&] {
      NodeMetrics m;
      if (req->has_loss()) m.loss = req->loss();
      if (req->has_tokens_per_s()) m.tokens_per_s = req->tokens_per_s();
      const size_t n = std::min<size_t>(req->losses_size(), kMaxHeartbeatLosses);
      for (size_t i = 0; i < n; ++i)
        m.losses.push_back({req->losses(i).step(), req->losses(i).loss()});
      rep->set_published_round(st_.heartbeat(caller(*ctx, req->node()), req->step(), m));
    });
  }

  grpc::Status Status(grpc::ServerContext* ctx, const pb::StatusRequest*,
                      pb::StatusReply* rep) override {
    return guarded("Status", *ctx, [&] {
      auth_.check_read(*ctx);
      const ServerStatus s = st_.status();
      rep->set_published_round(s.published_round);
      rep->set_published_step(s.published_step);
      rep->set_model_sha256(s.model_sha256);
      rep->set_collecting_round(s.collecting_round);
      rep->set_round_open_s(s.round_open_s);
      rep->set_protocol_version(s.protocol_version);
      rep->set_publish_error(s.publish_error);
      for (const auto& n : s.nodes) {
        pb::NodeStatus* p = rep->add_nodes();
        p->set_node_id(n.node_id);
        p->set_state(n.state);
        p->set_step(n.step);
        p->set_last_seen_s(n.last_seen_s);
        p->set_detail(n.detail);
        if (std::isfinite(n.loss)) p->set_loss(n.loss);
        if (std::isfinite(n.tokens_per_s)) p->set_tokens_per_s(n.tokens_per_s);
      }
    });
  }

 private:
  // Runs `body`, turning exceptions into a status. Refusals are logged through the throttle:
  // one line per source (the node the metadata names, else the peer's address), RPC and code
  // every 10 s, then a count of the rest.
  template <class F>
  grpc::Status guarded(const char* rpc, const grpc::ServerContext& ctx, F&& body) {
    try {
      body();
      return grpc::Status::OK;
    } catch (const SyncError& e) {
      const std::string key =
          fmt::format("{}|{}|{}", source(ctx), rpc, static_cast<int>(e.code()));
      if (auto line = refusals_.admit(key, fmt::format("{} refused: {}", rpc, e.what()))) {
        // Refusals of old rounds are routine after a deadline; the rest is worth a warning.
        if (e.code() == SyncErrc::OutOfRange || e.code() == SyncErrc::NotJoined)
          spdlog::info("{}", *line);
        else spdlog::warn("{}", *line);
      }
      return grpc::Status(grpc_code(e.code()), e.what());
    } catch (const std::exception& e) {
      const std::string key = fmt::format("{}|{}|failed", source(ctx), rpc);
      if (auto line = refusals_.admit(key, fmt::format("{} failed: {}", rpc,
                                                       printable(e.what()))))
        spdlog::error("{}", *line);
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, e.what());
    }
  }
  // Who a refusal is counted against: "node N" when the call names a node of the run (true or
  // not), else the peer's host (its port changes with every connection).
  std::string source(const grpc::ServerContext& ctx) const {
    const auto& md = ctx.client_metadata();
    const auto it = md.find(kNodeIdMetadata);
    if (it != md.end()) {
      const std::string id(it->second.data(), it->second.size());
      if (id.size() <= 6 && !id.empty() &&
          std::all_of(id.begin(), id.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
          std::stoll(id) < st_.model().plan().num_nodes())
        return "node " + id;
    }
    std::string peer = ctx.peer();
    const size_t colon = peer.rfind(':');
    if (colon != std::string::npos && peer.compare(0, 5, "unix:") != 0) peer.resize(colon);
    return printable(peer, 80);
  }

  // The caller as its metadata proves it; the message's node id must be the same node, and
  // gives the incarnation.
  NodeId caller(const grpc::ServerContext& ctx, const pb::NodeIdentity& body) const {
    NodeId n = auth_.node(ctx, body.incarnation());
    if (body.node_id() != n.node_id)
      sync_fail(SyncErrc::PermissionDenied, "the message names node {} but the call's "
                "credentials are node {}'s", body.node_id(), n.node_id);
    return n;
  }
  // Why a stream ended early: the server ended it (superseded, idle), or (a download) the node
  // went away. Throws, except for an upload whose node simply ended it.
  static void stream_end_reason(const StreamLimits::Lease& lease, int64_t node,
                                const char* what) {
    if (lease.superseded())
      sync_fail(SyncErrc::Aborted, "{} stream of node {} superseded by a newer one of the same "
                "node", what, node);
    if (lease.timed_out())
      sync_fail(SyncErrc::DeadlineExceeded, "{} stream of node {} sent nothing for too long "
                "and was ended", what, node);
    if (std::string(what) == "download")
      sync_fail(SyncErrc::Aborted, "download cancelled by the node, or it went away");
  }

  RoundState& st_;
  const CallAuth& auth_;
  StreamLimits& limits_;
  LongPollLimits& polls_;
  LogThrottle refusals_{10};
};

// Who may use the status page: the Host header must be an IP address, "localhost" or the
// configured dashboard_host (a DNS-rebinding page sends its own name); its data needs the read
// token whenever Status does, or whenever the page listens off loopback.
dashboard::DashboardAccess dashboard_access(const std::string& dashboard_host,
                                            const CallAuth& auth) {
  dashboard::DashboardAccess a;
  std::string name = dashboard_host;
  std::transform(name.begin(), name.end(), name.begin(), ::tolower);
  a.host_allowed = [name](const std::string& host) {
    return host == "localhost" || host == name || is_ip_literal(host);
  };
  if (auth.read_needs_token() || !is_loopback_host(dashboard_host)) {
    const CallAuth* p = &auth;
    a.token_ok = [p](const std::string& token) { return !token.empty() && p->read_allowed(token); };
    if (!is_loopback_host(dashboard_host))
      spdlog::warn("dashboard on {} over plain HTTP: its read token crosses the network in "
                   "cleartext (put it behind a TLS proxy, or keep dashboard_host on loopback)",
                   dashboard_host);
  }
  return a;
}

}  // namespace

struct SyncServer::Impl {
  ServerOptions opts;
  Config cfg;
  std::unique_ptr<RoundState> state;
  std::unique_ptr<CallAuth> auth;
  std::unique_ptr<StreamLimits> limits;
  LongPollLimits long_polls{kLongPollsPerNode};
  std::unique_ptr<Service> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<dashboard::DashboardServer> dashboard;  // destroyed first: it reads `state`
  int port = 0;
  std::string address;
  std::atomic<bool> stop{false};
};

SyncServer::SyncServer(const Config& cfg, ServerOptions opts) : impl_(std::make_unique<Impl>()) {
  impl_->opts = std::move(opts);
  impl_->cfg = cfg;
  const std::string& listen = impl_->opts.listen;
  const auto& sc = cfg.spes_config;
  // Secure by default: without node tokens anyone who reaches the port could upload as any
  // node, so only loopback is allowed.
  SPES_CHECK(!sc.auth_tokens_file.empty() || is_loopback_host(listen),
             "refusing to listen on '{}' without node tokens: anyone reaching the port could "
             "upload as any node. Write a YAML map of node id -> secret (e.g. `0: $(openssl "
             "rand -hex 16)`), set spes_config.auth_tokens_file to it, and give each node its "
             "token with --token-file or SPES_NODE_TOKEN (TLS: spes_config.tls_cert/tls_key)",
             listen);
  const bool loopback = is_loopback_host(listen);
  if (!loopback && sc.tls_cert.empty()) {
    SPES_CHECK(impl_->opts.insecure, "refusing to listen on '{}' without TLS: node tokens, "
               "uploads and the published model (and its digest) would cross the network in "
               "cleartext, so a listener could act as a node and a man in the middle could "
               "change the model. Set spes_config.tls_cert and tls_key (nodes: tls_ca), or pass "
               "--insecure to accept that risk", listen);
    spdlog::warn("--insecure: listening on {} WITHOUT TLS: anyone on the network path can read "
                 "the node tokens and act as a node, and can alter downloads and their "
                 "digests; use spes_config.tls_cert/tls_key", listen);
  }
  SPES_CHECK(!impl_->opts.bind_client_certs || !sc.tls_client_ca.empty(), "--bind-client-certs "
             "needs client certificates: set spes_config.tls_client_ca (and tls_cert/tls_key)");
  CallAuthOptions ao;
  ao.loopback_only = loopback;
  ao.read_token = read_token_file(impl_->opts.read_token_file, "--read-token-file");
  ao.bind_client_certs = impl_->opts.bind_client_certs;
  impl_->auth = std::make_unique<CallAuth>(cfg, ao);
  if (impl_->auth->read_needs_token() && ao.read_token.empty())
    spdlog::warn("sync server: off loopback without --read-token-file: Status (`spes status`) "
                 "and the dashboard's data are refused");
  impl_->limits = std::make_unique<StreamLimits>(impl_->opts.first_message_timeout_s,
                                                 impl_->opts.stream_idle_timeout_s);
  impl_->state = std::make_unique<RoundState>(cfg, impl_->opts.state);
  // The status page (spes_config.dashboard_port, -1: off) starts before the sync port is
  // bound, so that a dashboard port in use stops the server before any node can join.
  if (sc.dashboard_port >= 0) {
    const auto started = std::chrono::steady_clock::now();
    Impl* impl = impl_.get();
    impl_->dashboard = std::make_unique<dashboard::DashboardServer>(
        sc.dashboard_host, static_cast<int>(sc.dashboard_port), [impl, started] {
          const double up =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
          return dashboard_status(impl->cfg, *impl->state, up);
        }, dashboard_access(sc.dashboard_host, *impl_->auth));
  }
  impl_->service = std::make_unique<Service>(*impl_->state, *impl_->auth, *impl_->limits,
                                             impl_->long_polls);
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (!sc.tls_cert.empty()) {
    grpc::SslServerCredentialsOptions ssl(
        sc.tls_client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                 : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    ssl.pem_root_certs = read_pem(sc.tls_client_ca, "tls_client_ca");
    ssl.pem_key_cert_pairs.push_back(
        {read_pem(sc.tls_key, "tls_key"), read_pem(sc.tls_cert, "tls_cert")});
    creds = grpc::SslServerCredentials(ssl);
  }
  if (sc.auth_tokens_file.empty())
    spdlog::warn("sync server: no spes_config.auth_tokens_file: any local process may act as a "
                 "node; listening on loopback only");
  grpc::ServerBuilder b;
  b.AddListeningPort(listen, creds, &impl_->port);
  b.SetMaxReceiveMessageSize(kMaxMessageBytes);
  b.SetMaxSendMessageSize(kMaxMessageBytes);
  // Caps against floods: threads (each open call holds one; past the cap a call is refused
  // with RESOURCE_EXHAUSTED), streams per connection, and the size of a call's metadata.
  grpc::ResourceQuota quota("spes-sync-server");
  const int64_t threads = impl_->opts.max_threads > 0 ? impl_->opts.max_threads
                                                      : 64 + 8 * sc.num_peers;
  quota.SetMaxThreads(static_cast<int>(std::min<int64_t>(threads, 4096)));
  b.SetResourceQuota(quota);
  b.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kMaxStreamsPerConnection);
  b.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, kMaxMetadataBytes);
  b.RegisterService(impl_->service.get());
  impl_->server = b.BuildAndStart();
  SPES_CHECK(impl_->server && impl_->port > 0, "sync server: cannot listen on '{}' (address in "
             "use or invalid?)", listen);
  const std::string host = listen.substr(0, listen.rfind(':'));
  impl_->address = host + ":" + std::to_string(impl_->port);
  nlohmann::json info = {{"address", impl_->address}, {"pid", ::getpid()}};
  if (impl_->dashboard) info["dashboard"] = impl_->dashboard->url();
  file_write_atomic(run_layout::server_info(impl_->opts.state.out_dir), info.dump() + "\n");
  spdlog::info("sync server listening on {}", impl_->address);
}

SyncServer::~SyncServer() {
  if (impl_->server) impl_->server->Shutdown(std::chrono::system_clock::now() +
                                             std::chrono::seconds(2));
  impl_->state->close();
}

int SyncServer::port() const { return impl_->port; }
std::string SyncServer::address() const { return impl_->address; }
std::string SyncServer::dashboard_url() const {
  return impl_->dashboard ? impl_->dashboard->url() : std::string();
}
RoundState& SyncServer::state() { return *impl_->state; }
void SyncServer::stop() { impl_->stop = true; }

void SyncServer::run(const std::atomic<bool>* stop_flag) {
  for (;;) {
    if (impl_->stop || (stop_flag && *stop_flag)) break;
    if (impl_->opts.exit_when_done && impl_->state->all_left()) {
      spdlog::info("every node has left; the sync server stops");
      break;
    }
    impl_->state->tick();
    impl_->service->flush_refusal_logs();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  impl_->state->close();  // wakes long-polls so that Shutdown does not wait for them
  impl_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  impl_->server.reset();
}

}  // namespace spes::sync
