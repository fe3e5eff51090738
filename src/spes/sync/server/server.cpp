// gRPC glue of the sync server (see server.h): each RPC checks the caller's credentials from
// its metadata (call_auth.h) before it reads anything and its caller's call rate
// (call_rates.h), then maps onto one RoundState call (rpc_calls.h); streams take their node's
// slot and are watched for idleness (stream_limits.h), long-polls are limited per node
// (long_poll_limits.h); SyncError codes map onto gRPC status codes, and refusals are logged
// without flooding the log (log_throttle.h).
#include "spes/sync/server/server.h"

#include <fmt/ranges.h>
#include <grpc/grpc.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/server_posix.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <map>
#include <thread>

#include "spes/common/connection_guard.h"
#include "spes/common/guarded_listener.h"
#include "spes/dashboard/dashboard_server.h"
#include "spes/io/files.h"
#include "spes/io/run_layout.h"
#include "spes/common/strings.h"
#include "spes/sync/server/call_auth.h"
#include "spes/sync/server/call_rates.h"
#include "spes/sync/server/dashboard_status.h"
#include "spes/sync/server/grpc_log.h"
#include "spes/sync/server/log_throttle.h"
#include "spes/sync/server/long_poll_limits.h"
#include "spes/sync/server/rpc_calls.h"
#include "spes/sync/server/stream_limits.h"
#include "spes/sync/wire/auth.h"
#include "spes_sync.grpc.pb.h"

namespace spes::sync {

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


// What one caller may call, a second and at once (CallRates): an honest node heartbeats at
// most 10 times a second (heartbeat_interval_ms >= 100), holds one long-poll that ends when a
// round publishes or its wait runs out, and opens a few upload and download streams a round
// (retries back off from 0.2 s). The limits are several times that.
const std::map<std::string, CallRate>& call_rate_limits() {
  static const std::map<std::string, CallRate> rates = {
      {"Join", {2, 10}},       {"Leave", {2, 10}},     {"Upload", {5, 20}},
      {"Download", {5, 20}},   {"WaitRound", {20, 40}}, {"Heartbeat", {20, 40}},
      {"Status", {20, 40}},    {"HandOver", {2, 10}},  {"FetchMoments", {5, 20}}};
  return rates;
}

}  // namespace

// The gRPC service (outside the anonymous namespace: SyncServer::Impl holds one).
class SyncService final : public pb::SpesSync::Service {
 public:
  SyncService(RoundState& st, const CallAuth& auth, StreamLimits& limits, LongPollLimits& polls)
      : st_(st), auth_(auth), limits_(limits), polls_(polls) {}
  // The connection guard in front of gRPC: names the client behind a connection it handed over
  // and learns which addresses proved node credentials.
  void set_gate(GuardedListener* gate) { gate_ = gate; }

  // Logs the counts of refusals held back by the throttle (called periodically).
  void flush_refusal_logs() {
    for (const std::string& line : refusals_.flush()) spdlog::warn("{}", line);
  }

  grpc::Status Join(grpc::ServerContext* ctx, const pb::JoinRequest* req,
                    pb::JoinReply* rep) override {
    return guarded("Join", *ctx, [&] { call_join(st_, node_of(*ctx, "Join"), *req, rep); });
  }

  grpc::Status Upload(grpc::ServerContext* ctx, grpc::ServerReader<pb::UploadChunk>* reader,
                      pb::UploadReply* rep) override {
    return guarded("Upload", *ctx, [&] {
      // Credentials first: a stranger's stream ends here, before any of its bytes are read.
      const NodeId who = node_of(*ctx, "Upload");
      const auto lease =
          limits_.open(who.node_id, StreamKind::Upload, [ctx] { ctx->TryCancel(); });
      call_upload(st_, who, [&](pb::UploadChunk* c) {
        lease->waiting();
        const bool got = reader->Read(c);
        lease->received();
        if (!got) stream_end_reason(*lease, who.node_id, "upload");
        return got;
      }, rep);
    });
  }

  grpc::Status WaitRound(grpc::ServerContext* ctx, const pb::WaitRoundRequest* req,
                         pb::RoundInfo* rep) override {
    return guarded("WaitRound", *ctx, [&] {
      const NodeId who = node_of(*ctx, "WaitRound");
      // At most a few long-polls per node: a newer one ends the oldest early. A wait also ends
      // when its caller goes away (checked on every tick).
      const auto lease = polls_.open(who.node_id, [this] { st_.wake_waiters(); });
      call_wait_round(st_, who, *req,
                      [&] { return lease->ended_early() || ctx->IsCancelled(); }, rep);
    });
  }

  grpc::Status Download(grpc::ServerContext* ctx, const pb::DownloadRequest* req,
                        grpc::ServerWriter<pb::DownloadChunk>* writer) override {
    return guarded("Download", *ctx, [&] {
      const NodeId who = node_of(*ctx, "Download");
      // One download per node: a newer one ends this one (and this one ends an older one).
      const auto lease =
          limits_.open(who.node_id, StreamKind::Download, [ctx] { ctx->TryCancel(); });
      call_download(st_, who, *req, [&](const pb::DownloadChunk& c) {
        if (ctx->IsCancelled() || !writer->Write(c))
          stream_end_reason(*lease, who.node_id, "download");
      });
    });
  }

  grpc::Status HandOver(grpc::ServerContext* ctx, grpc::ServerReader<pb::MomentsChunk>* reader,
                        pb::HandOverReply* rep) override {
    return guarded("HandOver", *ctx, [&] {
      const NodeId who = node_of(*ctx, "HandOver");
      call_hand_over(st_, who, [&](pb::MomentsChunk* c) { return reader->Read(c); }, rep);
    });
  }

  grpc::Status FetchMoments(grpc::ServerContext* ctx, const pb::FetchMomentsRequest* req,
                            grpc::ServerWriter<pb::DownloadChunk>* writer) override {
    return guarded("FetchMoments", *ctx, [&] {
      call_fetch_moments(st_, node_of(*ctx, "FetchMoments"), *req,
                         [&](const pb::DownloadChunk& c) {
                           if (ctx->IsCancelled() || !writer->Write(c))
                             sync_fail(SyncErrc::Aborted, "moments fetch cancelled by the node");
                         });
    });
  }

  grpc::Status Leave(grpc::ServerContext* ctx, const pb::LeaveRequest* req,
                     pb::LeaveReply*) override {
    return guarded("Leave", *ctx, [&] { call_leave(st_, node_of(*ctx, "Leave"), *req); });
  }

  grpc::Status Heartbeat(grpc::ServerContext* ctx, const pb::HeartbeatRequest* req,
                         pb::HeartbeatReply* rep) override {
    return guarded("Heartbeat", *ctx,
                   [&] { call_heartbeat(st_, node_of(*ctx, "Heartbeat"), *req, rep); });
  }

  grpc::Status Status(grpc::ServerContext* ctx, const pb::StatusRequest*,
                      pb::StatusReply* rep) override {
    return guarded("Status", *ctx, [&] {
      // Callers holding the read token have a budget of their own (per host): a flood of
      // Status calls without it, from their host or any other, cannot starve them. The rest
      // are held to their host's rate before their credentials are looked at.
      const std::string host = peer_host(*ctx);
      limit_rate("Status", auth_.holds_read_token(*ctx) ? "read-token holder at " + host : host);
      auth_.check_read(*ctx);
      call_status(st_, rep);
    });
  }

 private:
  // Runs `body`, turning exceptions into a status. Refusals are logged through the throttle:
  // one line per source (the node the call's credentials prove, else the peer's host), RPC and
  // code every 10 s, then a count of the rest.
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
  // Who a refusal is counted against: "node N" when the call's credentials prove node N (a
  // stranger claiming node N's id counts against its own host, so it cannot hide node N's
  // refusals behind its own), else the peer's host.
  std::string source(const grpc::ServerContext& ctx) const {
    try {
      return "node " + std::to_string(auth_.node(ctx).node_id);
    } catch (const std::exception&) {
      return peer_host(ctx);
    }
  }
  // The peer's host (its port changes with every connection): the client behind the guard's
  // relay, not the relay's socket.
  std::string peer_host(const grpc::ServerContext& ctx) const {
    std::string peer = gate_ ? gate_->client_of(ctx.peer()) : ctx.peer();
    const size_t colon = peer.rfind(':');
    if (colon != std::string::npos && peer.compare(0, 5, "unix:") != 0) peer.resize(colon);
    return printable(peer, 80);
  }
  // The node the call's metadata proves (call_auth.h), within its call rate.
  NodeId node_of(const grpc::ServerContext& ctx, const char* rpc) {
    NodeId n = auth_.node(ctx);
    if (gate_) gate_->mark_known(ctx.peer());
    limit_rate(rpc, "node " + std::to_string(n.node_id));
    return n;
  }
  void limit_rate(const char* rpc, const std::string& caller) {
    if (rates_.admit(caller, rpc)) return;
    const CallRate r = rates_.rate(rpc);
    sync_fail(SyncErrc::Unavailable, "{} calls {} more often than {:g} a second (bursts of "
              "{:g}): refused, retry later", caller, rpc, r.per_s, r.burst);
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
  GuardedListener* gate_ = nullptr;
  CallRates rates_{call_rate_limits()};
  LogThrottle refusals_{10};
};

namespace {

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
  std::unique_ptr<SyncService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<GuardedListener> gate;  // in front of gRPC when it speaks plaintext
  std::unique_ptr<dashboard::DashboardServer> dashboard;  // destroyed first: it reads `state`
  int port = 0;
  std::string address;
  std::atomic<bool> stop{false};
  std::string insecure_warning;  // what --insecure let through (logged, on the status page)

  // The constructor's steps.
  void check_listen_security();
  void make_call_auth();
  void start_dashboard();
  std::shared_ptr<grpc::ServerCredentials> credentials() const;
  void start_grpc();
  void start_gate(int tls_port);
  void write_server_info() const;
};

void SyncServer::Impl::check_listen_security() {
  const std::string& listen = opts.listen;
  const SyncTransport& tr = cfg.spes_config.transport;
  // Secure by default: without node tokens anyone who reaches the port could upload as any
  // node, so only loopback is allowed.
  SPES_CHECK(!tr.auth_tokens_file.empty() || is_loopback_host(listen),
             "refusing to listen on '{}' without node tokens: anyone reaching the port could "
             "upload as any node. Write a YAML map of node id -> secret (e.g. `0: $(openssl "
             "rand -hex 16)`), set spes_config.auth_tokens_file to it, and give each node its "
             "token with --token-file or SPES_NODE_TOKEN (TLS: spes_config.tls_cert/tls_key)",
             listen);
  if (!is_loopback_host(listen) && tr.tls_cert.empty()) {
    SPES_CHECK(opts.insecure, "refusing to listen on '{}' without TLS: node tokens, "
               "uploads and the published model (and its digest) would cross the network in "
               "cleartext, so a listener could act as a node and a man in the middle could "
               "change the model. Make the run's certificates with `spes certs --out DIR "
               "--nodes N --host NAME` and start with --tls-dir DIR, or pass --insecure to "
               "accept that risk", listen);
    insecure_warning = fmt::format("--insecure: listening on {} WITHOUT TLS: anyone on the "
                                   "network path can read the node tokens and act as a node, "
                                   "and can alter downloads and their digests; use spes certs "
                                   "and --tls-dir", listen);
  } else if (!is_loopback_host(listen) && tr.tls_client_ca.empty()) {
    // Mutual TLS by default off loopback (issue 35, finding 1): without client certificates a
    // stranger's HTTP/2 reaches gRPC 1.51's header parser (CVE-2023-33953).
    SPES_CHECK(opts.insecure, "refusing to listen on '{}' with TLS but without client "
               "certificates: any stranger's HTTP/2 would reach gRPC's header parser, whose CPU "
               "time grows quadratically with large header blocks (gRPC 1.51, CVE-2023-33953). "
               "Make the run's certificates with `spes certs --out DIR --nodes N --host NAME` and "
               "start with --tls-dir DIR (or set spes_config.tls_client_ca), or pass --insecure "
               "to accept that risk", listen);
    insecure_warning = fmt::format("--insecure: listening on {} with TLS but WITHOUT client "
                                   "certificates: strangers reach gRPC's HTTP/2 parser (header "
                                   "floods, CVE-2023-33953); use spes certs and --tls-dir",
                                   listen);
  }
  if (!insecure_warning.empty()) spdlog::warn("{}", insecure_warning);
  SPES_CHECK(!opts.bind_client_certs || !tr.tls_client_ca.empty(), "--bind-client-certs "
             "needs client certificates: set spes_config.tls_client_ca (and tls_cert/tls_key)");
  if (tr.auth_tokens_file.empty())
    spdlog::warn("sync server: no spes_config.auth_tokens_file: any local process may act as a "
                 "node; listening on loopback only");
}

void SyncServer::Impl::make_call_auth() {
  CallAuthOptions ao;
  ao.loopback_only = is_loopback_host(opts.listen);
  ao.read_token = read_token_file(opts.read_token_file, "--read-token-file");
  ao.bind_client_certs = opts.bind_client_certs;
  auth = std::make_unique<CallAuth>(cfg, ao);
  if (auth->read_needs_token() && ao.read_token.empty())
    spdlog::warn("sync server: off loopback without --read-token-file: Status (`spes status`) "
                 "and the dashboard's data are refused");
}

void SyncServer::Impl::start_dashboard() {
  // The status page (spes_config.dashboard_port, -1: off) starts before the sync port is
  // bound, so that a dashboard port in use stops the server before any node can join.
  const DashboardSettings& d = cfg.spes_config.dashboard;
  if (d.port < 0) return;
  const auto started = std::chrono::steady_clock::now();
  dashboard = std::make_unique<dashboard::DashboardServer>(
      d.host, static_cast<int>(d.port), [this, started] {
        const double up =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
        nlohmann::json j = dashboard_status(cfg, *state, up);
        if (!insecure_warning.empty()) j["security_warning"] = insecure_warning;
        return j;
      }, dashboard_access(d.host, *auth));
}

std::shared_ptr<grpc::ServerCredentials> SyncServer::Impl::credentials() const {
  const SyncTransport& tr = cfg.spes_config.transport;
  if (tr.tls_cert.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl(
      tr.tls_client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                               : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  ssl.pem_root_certs = read_pem(tr.tls_client_ca, "tls_client_ca");
  ssl.pem_key_cert_pairs.push_back(
      {read_pem(tr.tls_key, "tls_key"), read_pem(tr.tls_cert, "tls_cert")});
  return grpc::SslServerCredentials(ssl);
}

namespace {

// Destroying the last gRPC object of a process runs grpc_shutdown, which joins gRPC's executor
// threads; in gRPC 1.51 one of them can be inside a poll bounded by a pending handshake's
// deadline (the 10 s handshake timeout), so `spes serve` sometimes took 10 s more to exit once
// every node had left (grpc/grpc#41050 reports the same delay). The server holds one library
// reference for the life of the process, so shutting a server down never tears gRPC down: the
// threads end with the process.
void hold_grpc_for_the_process() {
  static const bool held = [] {
    grpc_init();
    return true;
  }();
  (void)held;
}

}  // namespace

void SyncServer::Impl::start_grpc() {
  hold_grpc_for_the_process();
  service = std::make_unique<SyncService>(*state, *auth, *limits, long_polls);
  route_grpc_logs();  // before gRPC logs anything of this server
  grpc::ServerBuilder b;
  // The guard owns the port (start_gate). Plaintext: it hands gRPC each admitted connection.
  // TLS: it relays each one to gRPC's own listener on loopback, which does the handshake
  // (client certificates verified before any HTTP/2) within the handshake timeout.
  int tls_port = 0;
  if (!cfg.spes_config.transport.tls_cert.empty())
    b.AddListeningPort("127.0.0.1:0", credentials(), &tls_port);
  b.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                       static_cast<int>(opts.guard.first_bytes_timeout_s * 1000));
  b.SetMaxReceiveMessageSize(kMaxMessageBytes);
  b.SetMaxSendMessageSize(kMaxMessageBytes);
  // Caps against floods: threads (each open call holds one; past the cap a call is refused
  // with RESOURCE_EXHAUSTED), streams per connection, and the size of a call's metadata.
  grpc::ResourceQuota quota("spes-sync-server");
  const int64_t threads =
      opts.max_threads > 0 ? opts.max_threads : 64 + 8 * cfg.spes_config.node_slots();
  quota.SetMaxThreads(static_cast<int>(std::min<int64_t>(threads, 4096)));
  b.SetResourceQuota(quota);
  b.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kMaxStreamsPerConnection);
  b.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, kMaxMetadataBytes);
  b.RegisterService(service.get());
  server = b.BuildAndStart();
  SPES_CHECK(server, "sync server: gRPC did not start");
  SPES_CHECK(cfg.spes_config.transport.tls_cert.empty() || tls_port > 0, "sync server: gRPC "
             "could not listen with TLS on loopback (check tls_cert, tls_key, tls_client_ca)");
  start_gate(tls_port);
  SPES_CHECK(port > 0, "sync server: cannot listen on '{}' (address in use or invalid?)",
             opts.listen);
  address = opts.listen.substr(0, opts.listen.rfind(':')) + ":" + std::to_string(port);
}

// The connection guard (common/guarded_listener.h) on opts.listen: connections counted in total
// and per address, room kept for addresses that proved node credentials, the first bytes
// within the handshake timeout, idle ones closed; the admitted ones go to gRPC (handed over,
// or relayed to its TLS listener on loopback, `tls_port`).
void SyncServer::Impl::start_gate(int tls_port) {
  GuardSettings g = opts.guard;
  // What a connection starts with: HTTP/2's preface, or a TLS handshake record (type 22,
  // version 3.x), whose rest gRPC's handshaker reads within the handshake timeout.
  g.preface = tls_port > 0 ? std::string("\x16\x03") : "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  g.forward_port = tls_port;
  // Each relayed connection holds 3 descriptors (the client's socket and a socketpair); keep
  // the cap where the descriptors last, with room for the rest of the server.
  const uint64_t fds = raise_descriptor_limit();
  const int64_t fit = std::max<int64_t>(16, (static_cast<int64_t>(fds) - 128) / 3);
  if (g.max_connections > fit) {
    spdlog::warn("connection guard: {} connections would need more descriptors than the {} "
                 "this process may open: at most {}", g.max_connections, fds, fit);
    g.max_connections = fit;
  }
  if (g.reserved_for_known < 0) g.reserved_for_known = 8 * cfg.spes_config.node_slots();
  g.reserved_for_known = std::min(g.reserved_for_known, g.max_connections / 2);
  grpc::Server* s = server.get();
  gate = std::make_unique<GuardedListener>(opts.listen, g,
                                           [s](int fd) { grpc::AddInsecureChannelFromFd(s, fd); });
  port = gate->port();
  service->set_gate(gate.get());
  spdlog::info("connection guard: at most {} connections, {} per address, {} kept for nodes; "
               "HTTP/2 preface within {:g} s, idle ones closed after {:g} s",
               g.max_connections, g.per_address, g.reserved_for_known, g.first_bytes_timeout_s,
               g.idle_timeout_s);
}

void SyncServer::Impl::write_server_info() const {
  nlohmann::json info = {{"address", address}, {"pid", ::getpid()}};
  if (dashboard) info["dashboard"] = dashboard->url();
  file_write_atomic(run_layout::server_info(opts.state.out_dir), info.dump() + "\n");
}

SyncServer::SyncServer(const Config& cfg, ServerOptions opts,
                       std::optional<InitialWeights> initial)
    : impl_(std::make_unique<Impl>()) {
  impl_->opts = std::move(opts);
  impl_->cfg = cfg;
  impl_->check_listen_security();
  // Connections hold descriptors: as many as the system allows this process.
  spdlog::info("sync server: up to {} open descriptors", raise_descriptor_limit());
  impl_->make_call_auth();
  impl_->limits = std::make_unique<StreamLimits>(impl_->opts.first_message_timeout_s,
                                                 impl_->opts.stream_idle_timeout_s);
  impl_->state = std::make_unique<RoundState>(cfg, impl_->opts.state, std::move(initial));
  impl_->start_dashboard();
  impl_->start_grpc();
  impl_->write_server_info();
  spdlog::info("sync server listening on {}", impl_->address);
}

SyncServer::~SyncServer() {
  impl_->gate.reset();  // no new connections for a server that is going away
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
      const std::vector<int64_t> gone = impl_->state->gone_without_leaving();
      if (gone.empty())
        spdlog::info("every node has left; the sync server stops");
      else
        spdlog::warn("the run's last round {} is published and node(s) [{}] did not leave but "
                     "are dead or did not join within spes_config.heartbeat_timeout ({} s); "
                     "the sync server stops (--keep-running keeps it serving)",
                     impl_->state->published_round(), fmt::join(gone, ", "),
                     impl_->cfg.spes_config.timing.heartbeat_timeout);
      break;
    }
    impl_->state->tick();
    impl_->service->flush_refusal_logs();
    for (const std::string& line : flush_grpc_logs()) spdlog::warn("{}", line);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  impl_->state->close();  // wakes long-polls so that Shutdown does not wait for them
  impl_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  impl_->server.reset();
}

}  // namespace spes::sync
