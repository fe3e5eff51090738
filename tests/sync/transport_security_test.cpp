// Credentials and transport of the sync server (issue 13, items 2 and 3's stream limits):
// loopback detection by parsing; token files private to their owner; a node and `spes serve`
// refusing plaintext off loopback unless told --insecure; node tokens checked in one place
// (CallAuth), as call metadata, before a stream is read (a token in a message body no longer
// counts); one upload and one download stream per node; idle streams ended; a flood of streams
// holding no threads; at most two long-polls per node; the read token of Status; client
// certificates bound to node ids. (The dashboard's Host check and read
// token: tests/dashboard/dashboard_server_test.cpp.) Hostile clients are raw gRPC stubs
// against a real `spes serve` on loopback.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "spes/io/files.h"
#include "spes/sync/node/client.h"
#include "spes/sync/server/call_auth.h"
#include "spes/sync/server/long_poll_limits.h"
#include "spes/sync/server/server.h"
#include "spes/sync/server/stream_limits.h"
#include "spes/sync/wire/auth.h"
#include "spes_sync.grpc.pb.h"
#include "sync/serve_fixture.h"
#include "sync/sync_process_util.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;
using ::testing::HasSubstr;
using ::testing::Not;
namespace fs = std::filesystem;
namespace pb = ::spes::sync::v1;

namespace {

const fs::perms kWorldReadable = kPrivate | fs::perms::group_read | fs::perms::others_read;

}  // namespace

TEST(TransportSecurity, LoopbackHostsAreParsedNotPrefixMatched) {
  for (const char* a : {"127.0.0.1:5000", "127.1.2.3:0", "127.0.0.1", "localhost:80", "localhost",
                        "[::1]:5000", "::1", "[::ffff:127.0.0.1]:1", "ipv4:127.0.0.1:9",
                        "dns:///localhost:9", "unix:/tmp/spes.sock"})
    EXPECT_TRUE(is_loopback_host(a)) << a;
  for (const char* a : {"127.evil.com:5000", "127.0.0.1.evil.com:80", "localhost.evil.com:1",
                        "0.0.0.0:5000", "[::]:5000", "10.0.0.1:80", "128.0.0.1:80", "127.1:80",
                        "LOCALHOSTX", "[::2]:1", "dns:///127.evil.com:9", "example.com:443", ""})
    EXPECT_FALSE(is_loopback_host(a)) << a;
  EXPECT_TRUE(is_ip_literal("10.1.2.3"));
  EXPECT_TRUE(is_ip_literal("[fe80::1]"));
  EXPECT_FALSE(is_ip_literal("127.evil.com"));
}

TEST(TransportSecurity, SecretFilesReadableByOthersAreRefused) {
  TempDir tmp;
  const std::string tokens = tmp.path + "/tokens.yaml", node = tmp.path + "/node.token",
                    read = tmp.path + "/read.token";
  write_secret(tokens, "0: token-of-node-zero-0123456789\n1: token-of-node-one-0123456789\n",
               kWorldReadable);
  write_secret(node, "token-of-node-zero-0123456789\n", kWorldReadable);
  write_secret(read, "read-token-0123456789abcdef\n", kWorldReadable);
  EXPECT_THAT(error_of([&] { load_node_tokens(tokens, 2); }), HasSubstr("chmod 600 " + tokens));
  EXPECT_THAT(error_of([&] { node_token(node); }), HasSubstr("chmod 600 " + node));
  EXPECT_THAT(error_of([&] { read_token_file(read, "--read-token-file"); }),
              HasSubstr("chmod 600 " + read));
  for (const auto& p : {tokens, node, read}) fs::permissions(p, kPrivate);
  EXPECT_EQ(load_node_tokens(tokens, 2).at(1), "token-of-node-one-0123456789");
  EXPECT_EQ(node_token(node), "token-of-node-zero-0123456789");
  EXPECT_EQ(read_token_file(read, "--read-token-file"), "read-token-0123456789abcdef");
}

// The one check of a node's credentials (the server's state trusts the NodeId it is given).
TEST(TransportSecurity, NodeTokensAreCheckedAndNeverEchoed) {
  TempDir tmp;
  const std::string t0 = "token-of-node-zero-0123456789", t1 = "token-of-node-one-9876543210";
  write_secret(tmp.path + "/tokens.yaml", "0: " + t0 + "\n1: " + t1 + "\n", kPrivate);
  const Config cfg = tiny_config({"spes_config.auth_tokens_file=" + tmp.path + "/tokens.yaml"});
  const CallAuth auth(cfg, CallAuthOptions{});
  EXPECT_TRUE(auth.requires_tokens());
  EXPECT_EQ(code_of([&] { auth.check("0", t1, {}); }), SyncErrc::PermissionDenied);
  EXPECT_THAT(error_of([&] { auth.check("0", t1, {}); }), Not(HasSubstr(t1)));
  EXPECT_EQ(code_of([&] { auth.check("1", "", {}); }), SyncErrc::PermissionDenied);
  EXPECT_EQ(code_of([&] { auth.check("0", "x" + t0, {}); }), SyncErrc::PermissionDenied);
  for (const char* id : {"7", "-1", "", "0x1", "1 ", "99999999999999999999"})
    EXPECT_EQ(code_of([&] { auth.check(id, t0, {}); }), SyncErrc::PermissionDenied) << id;
  const NodeId ok = auth.check("1", t1, {}, 42);
  EXPECT_EQ(ok.node_id, 1);
  EXPECT_EQ(ok.incarnation, 42u);
  // Without a token file (loopback only) any id of the run is taken at its word.
  const CallAuth open_auth(tiny_config(), CallAuthOptions{});
  EXPECT_FALSE(open_auth.requires_tokens());
  EXPECT_EQ(open_auth.check("1", "", {}).node_id, 1);
  EXPECT_EQ(code_of([&] { open_auth.check("2", "", {}); }), SyncErrc::PermissionDenied);
  // With --bind-client-certs the certificate must name the node.
  CallAuthOptions bound;
  bound.bind_client_certs = true;
  const CallAuth cert_auth(cfg, bound);
  EXPECT_EQ(cert_auth.check("0", t0, {"spes-ca", "node0"}).node_id, 0);
  EXPECT_THAT(error_of([&] { cert_auth.check("0", t0, {"node1"}); }),
              HasSubstr("does not name 'node0'"));
  // Bad token files are explained.
  write_secret(tmp.path + "/short.yaml", "0: abc\n1: " + t1 + "\n", kPrivate);
  EXPECT_THAT(error_of([&] {
                CallAuth bad(tiny_config({"spes_config.auth_tokens_file=" + tmp.path +
                                          "/short.yaml"}), CallAuthOptions{});
              }),
              HasSubstr("shorter than 16"));
}

TEST(TransportSecurity, NodeRefusesPlaintextOffLoopbackAndACertificateWithoutRoots) {
  const NodeId id{0, 1, "token-of-node-zero-0123456789"};
  EXPECT_THAT(error_of([&] { SyncClient c("10.1.2.3:50551", id); }), HasSubstr("--insecure"));
  EXPECT_THAT(error_of([&] { SyncClient c("127.evil.com:50551", id); }),
              HasSubstr("--insecure"));
  ClientTls insecure;
  insecure.insecure = true;
  EXPECT_EQ(error_of([&] { SyncClient c("10.1.2.3:50551", id, insecure); }), "");
  EXPECT_EQ(error_of([&] { SyncClient c("127.0.0.1:50551", id); }), "");
  ClientTls cert_only;  // a client certificate but no roots: would have been plaintext
  cert_only.cert_pem = "-----BEGIN CERTIFICATE-----";
  cert_only.key_pem = "-----BEGIN PRIVATE KEY-----";
  EXPECT_THAT(error_of([&] { SyncClient c("127.0.0.1:50551", id, cert_only); }),
              HasSubstr("set spes_config.tls_ca"));
}

TEST(TransportSecurity, ServerRefusesPlaintextOffLoopbackUnlessInsecure) {
  TempDir tmp;
  write_secret(tmp.path + "/tokens.yaml",
               "0: token-of-node-zero-0123456789\n1: token-of-node-one-0123456789\n", kPrivate);
  const Config cfg = tiny_config({"spes_config.auth_tokens_file=" + tmp.path + "/tokens.yaml",
                                  "spes_config.dashboard_port=-1"});
  ServerOptions o;
  o.listen = "0.0.0.0:0";
  o.state.out_dir = tmp.path + "/srv";
  EXPECT_THAT(error_of([&] { SyncServer s(cfg, o); }), HasSubstr("pass --insecure"));
  o.insecure = true;
  SyncServer s(cfg, o);
  EXPECT_GT(s.port(), 0);
}

TEST(TransportSecurity, StreamLimitsSupersedeOlderStreamsAndEndIdleOnes) {
  std::atomic<int> cancelled[4] = {0, 0, 0, 0};
  auto cancel = [&](int i) { return [&cancelled, i] { ++cancelled[i]; }; };
  {
    StreamLimits limits(/*first_message_s=*/3600, /*idle_s=*/3600);
    auto a = limits.open(0, StreamKind::Upload, cancel(0));
    auto b = limits.open(0, StreamKind::Download, cancel(1));
    auto c = limits.open(1, StreamKind::Upload, cancel(2));
    EXPECT_EQ(cancelled[0] + cancelled[1] + cancelled[2], 0);  // other kind, other node
    auto d = limits.open(0, StreamKind::Upload, cancel(3));   // node 0's second upload
    EXPECT_EQ(cancelled[0], 1);
    EXPECT_TRUE(a->superseded());
    EXPECT_FALSE(d->superseded());
    EXPECT_EQ(limits.open_streams(), 4u);
    a.reset();  // the superseded stream ends: its slot stays with the newer one
    auto e = limits.open(0, StreamKind::Upload, [] {});
    EXPECT_EQ(cancelled[3], 1);
    EXPECT_EQ(cancelled[1] + cancelled[2], 0);
  }
  // A stream that waits longer than the first-message limit is cancelled by the watchdog.
  StreamLimits limits(/*first_message_s=*/0.2, /*idle_s=*/3600);
  std::atomic<int> idle{0};
  auto s = limits.open(5, StreamKind::Upload, [&] { ++idle; });
  s->waiting();
  for (int i = 0; i < 3000 && idle == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(idle, 1);
  EXPECT_TRUE(s->timed_out());
}

TEST(TransportSecurity, LongPollsPerNodeAreLimitedAndANewerOneEndsTheOldest) {
  LongPollLimits polls(2);
  std::atomic<int> woken{0};
  auto wake = [&] { ++woken; };
  auto a = polls.open(0, wake);
  auto b = polls.open(0, wake);
  auto c = polls.open(1, wake);  // another node: its own limit
  EXPECT_EQ(woken, 0);
  auto d = polls.open(0, wake);  // node 0's third: its oldest (a) ends
  EXPECT_EQ(woken, 1);
  EXPECT_TRUE(a->ended_early());
  EXPECT_FALSE(b->ended_early() || c->ended_early() || d->ended_early());
  EXPECT_EQ(polls.open_polls(), 4u);
  a.reset();  // the ended one answers and goes: it held no place any more
  auto e = polls.open(0, wake);  // node 0 has b and d running: b ends
  EXPECT_TRUE(b->ended_early());
  EXPECT_FALSE(d->ended_early());
  b.reset();
  d.reset();
  auto f = polls.open(0, wake);  // only e runs: nothing ends
  EXPECT_EQ(woken, 2);
  EXPECT_EQ(polls.open_polls(), 3u);
}

namespace {

const std::string kToken0 = ServeFixture::token(0);
const std::string kToken1 = ServeFixture::token(1);

// Joins node `node` (incarnation `incarnation`) the way a real node does (SyncClient).
void join_node(const ServeFixture& f, int64_t node, uint64_t incarnation,
               const std::string& token) {
  FakeNode n(f.cfg, node, 1);
  n.id = NodeId{node, incarnation, token};
  SyncClient(f.address, n.id).join(n.join_info());
}

grpc::Status heartbeat(pb::SpesSync::Stub& stub, int64_t meta_node, const std::string& token,
                       const pb::NodeIdentity& body) {
  grpc::ClientContext ctx;
  set_deadline(ctx, 60);
  if (meta_node >= 0) credentials(ctx, meta_node, token);
  pb::HeartbeatRequest req;
  *req.mutable_node() = body;
  pb::HeartbeatReply rep;
  return stub.Heartbeat(&ctx, req, &rep);
}

}  // namespace

TEST(TransportSecurityServer, TokensTravelAsCallMetadataAndAreCheckedBeforeAStreamIsRead) {
  ServeFixture f;
  ASSERT_FALSE(f.address.empty()) << f.srv->log();
  auto stub = f.stub();
  join_node(f, 0, 77, kToken0);
  pb::NodeIdentity body;
  body.set_node_id(0);
  body.set_incarnation(77);
  EXPECT_TRUE(heartbeat(*stub, 0, kToken0, body).ok());
  // The token of protocol v2's bodies (NodeIdentity field 3) is no longer a credential: the
  // same call with the token only in the body is refused.
  pb::NodeIdentity with_body_token;
  ASSERT_TRUE(with_body_token.ParseFromString(
      body.SerializeAsString() + std::string("\x1a") +
      static_cast<char>(std::string(kToken0).size()) + kToken0));
  const grpc::Status body_only = heartbeat(*stub, -1, "", with_body_token);
  EXPECT_EQ(body_only.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << body_only.error_message();
  EXPECT_EQ(heartbeat(*stub, 0, kToken1, body).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(heartbeat(*stub, 0, "", body).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  // Node 1's credentials cannot speak for node 0 (the body names node 0).
  EXPECT_EQ(heartbeat(*stub, 1, kToken1, body).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  // An upload stream without credentials ends before it sends anything: the server refuses it
  // from the metadata alone instead of waiting for its first message.
  grpc::ClientContext ctx;
  set_deadline(ctx, 60);
  pb::UploadReply rep;
  auto w = stub->Upload(&ctx, &rep);
  const grpc::Status s = w->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_THAT(s.error_message(), Not(HasSubstr(kToken0)));
  EXPECT_FALSE(f.srv->exited) << f.srv->log();
}

TEST(TransportSecurityServer, FloodsOfIdleStreamsEndAndHoldNoThreads) {
  ServeFixture f({{"--first-message-timeout", "2"}});
  ASSERT_FALSE(f.address.empty()) << f.srv->log();
  const size_t before = f.threads();
  // 400 streams over 8 connections, none sending a message: 200 without credentials, 200 with
  // node 0's (each new one supersedes the previous; the last is ended by the first-message
  // deadline).
  struct Open {
    grpc::ClientContext ctx;
    pb::UploadReply rep;
    std::unique_ptr<grpc::ClientWriter<pb::UploadChunk>> w;
    bool authenticated = false;
  };
  std::vector<std::unique_ptr<pb::SpesSync::Stub>> stubs;
  for (int i = 0; i < 8; ++i) stubs.push_back(f.stub(/*own_connection=*/true));
  std::vector<std::unique_ptr<Open>> streams;
  for (int i = 0; i < 400; ++i) {
    auto o = std::make_unique<Open>();
    o->authenticated = i % 2 == 1;
    set_deadline(o->ctx, 120);
    if (o->authenticated) credentials(o->ctx, 0, kToken0);
    o->w = stubs[i % 8]->Upload(&o->ctx, &o->rep);
    streams.push_back(std::move(o));
  }
  // A call behind them on each connection: the server has received every stream's headers.
  for (auto& stub : stubs) {
    grpc::ClientContext ctx;
    set_deadline(ctx, 60);
    pb::StatusReply st;
    (void)stub->Status(&ctx, pb::StatusRequest(), &st);  // may meet the thread cap: no matter
  }
  // Before the client looks at any of them, the server has ended them all: its threads go
  // back to about what it had before (today's code: one blocked thread per idle stream, 400
  // more until the clients' deadline).
  size_t now = f.threads();
  for (int i = 0; i < 3000 && now > before + 40; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    now = f.threads();
  }
  EXPECT_LE(now, before + 40) << "threads before: " << before;
  // Each ended by the server's doing, long before the client's deadline: refused for its
  // credentials, ended (superseded or idle; the client sees CANCELLED), refused by node 0's
  // call rate (UNAVAILABLE, past its burst of upload streams), or refused by the thread cap
  // while the flood was at its height ("Server Threadpool Exhausted").
  size_t denied = 0, ended = 0, limited = 0, capped = 0, other = 0;
  std::string others;
  for (auto& o : streams) {
    const grpc::Status s = o->w->Finish();
    const auto code = s.error_code();
    if (code == grpc::StatusCode::RESOURCE_EXHAUSTED) ++capped;
    else if (!o->authenticated && code == grpc::StatusCode::PERMISSION_DENIED) ++denied;
    else if (o->authenticated && code == grpc::StatusCode::CANCELLED) ++ended;
    else if (o->authenticated && code == grpc::StatusCode::UNAVAILABLE) ++limited;
    else if (++other < 5) others += std::to_string(code) + " " + s.error_message() + "; ";
  }
  EXPECT_EQ(other, 0u) << others;
  EXPECT_GT(denied, 0u);
  EXPECT_GT(ended, 0u);
  EXPECT_EQ(denied + ended + limited + capped, 400u);
  // The server still answers.
  grpc::ClientContext ctx;
  set_deadline(ctx, 60);
  pb::StatusReply st;
  EXPECT_TRUE(f.stub()->Status(&ctx, pb::StatusRequest(), &st).ok());
  EXPECT_FALSE(f.srv->exited) << f.srv->log();
}

TEST(TransportSecurityServer, ANewDownloadOfANodeEndsItsOlderOne) {
  ServeFixture f;
  ASSERT_FALSE(f.address.empty()) << f.srv->log();
  auto stub = f.stub();
  join_node(f, 0, 5, kToken0);
  pb::DownloadRequest req;
  req.mutable_node()->set_node_id(0);
  req.mutable_node()->set_incarnation(5);
  req.set_round(0);
  req.set_selection(pb::SELECTION_ALL);
  // The first download is not read: the server is stuck writing its first chunk.
  grpc::ClientContext first_ctx;
  set_deadline(first_ctx, 120);
  credentials(first_ctx, 0, kToken0);
  auto first = stub->Download(&first_ctx, req);
  // Wait for the server to have the first one open (the stream's headers arrive with its
  // first write).
  first->WaitForInitialMetadata();
  grpc::ClientContext second_ctx;
  set_deadline(second_ctx, 120);
  credentials(second_ctx, 0, kToken0);
  auto second = stub->Download(&second_ctx, req);
  pb::DownloadChunk c;
  uint64_t got = 0, total = 0;
  while (second->Read(&c)) {
    got += c.data().size();
    total = c.total_bytes();
  }
  ASSERT_TRUE(second->Finish().ok());
  EXPECT_EQ(got, total);
  EXPECT_GT(total, 1u << 20);
  uint64_t first_got = 0, first_total = 0;
  while (first->Read(&c)) {
    first_got += c.data().size();
    first_total = c.total_bytes();
  }
  const grpc::Status s = first->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  EXPECT_TRUE(first_total == 0 || first_got < first_total);
}

TEST(TransportSecurityServer, ANodeHoldsAtMostTwoLongPollsAndANewerOneEndsTheOldest) {
  ServeFixture f;
  ASSERT_FALSE(f.address.empty()) << f.srv->log();
  join_node(f, 0, 5, kToken0);
  auto stub = f.stub();
  grpc::CompletionQueue cq;
  struct Poll {
    grpc::ClientContext ctx;
    pb::RoundInfo rep;
    grpc::Status status;
    std::unique_ptr<grpc::ClientAsyncResponseReader<pb::RoundInfo>> call;
    bool done = false;
  };
  std::vector<std::unique_ptr<Poll>> polls;
  // Five long-polls of node 0 for round 3, which is not being collected: each would wait the
  // whole 30 s (before: five server threads held that long, and any number more).
  for (int i = 0; i < 5; ++i) {
    auto p = std::make_unique<Poll>();
    set_deadline(p->ctx, 300);
    credentials(p->ctx, 0, kToken0);
    pb::WaitRoundRequest req;
    req.mutable_node()->set_node_id(0);
    req.mutable_node()->set_incarnation(5);
    req.set_round(3);
    req.set_max_wait_ms(30000);
    p->call = stub->AsyncWaitRound(&p->ctx, req, &cq);
    p->call->Finish(&p->rep, &p->status, p.get());
    polls.push_back(std::move(p));
  }
  auto done = [&] {
    return std::count_if(polls.begin(), polls.end(), [](const auto& p) { return p->done; });
  };
  // Collects finished calls until `want` have finished, or none came for `quiet_s`.
  auto collect = [&](long want, double quiet_s) {
    while (done() < want) {
      void* tag = nullptr;
      bool ok = false;
      const auto r = cq.AsyncNext(&tag, &ok, std::chrono::system_clock::now() +
                                                 std::chrono::milliseconds(
                                                     static_cast<int64_t>(quiet_s * 1000)));
      if (r != grpc::CompletionQueue::GOT_EVENT) return;
      static_cast<Poll*>(tag)->done = true;
    }
  };
  // The three oldest end at once with the round's state (not published); two keep waiting.
  collect(3, 120);
  collect(5, 1);
  EXPECT_EQ(done(), 3);
  for (const auto& p : polls)
    if (p->done) {
      EXPECT_TRUE(p->status.ok()) << p->status.error_message();
      EXPECT_EQ(p->rep.round(), 3);
      EXPECT_FALSE(p->rep.published());
    }
  // The server still answers; the two left end when their caller cancels them.
  grpc::ClientContext st_ctx;
  set_deadline(st_ctx, 60);
  pb::StatusReply st;
  EXPECT_TRUE(stub->Status(&st_ctx, pb::StatusRequest(), &st).ok());
  for (auto& p : polls)
    if (!p->done) p->ctx.TryCancel();
  collect(5, 120);
  EXPECT_EQ(done(), 5);
  EXPECT_FALSE(f.srv->exited) << f.srv->log();
}

// Issue 35, finding 2 (in part): idle connections from one stranger exhausted the server's
// descriptors (soft limit 1024). `spes serve` raises its limit to the most the system allows:
// started with a soft limit of 256, it runs with its hard limit.
TEST(TransportSecurityServer, TheServerRaisesItsDescriptorLimit) {
  rlimit mine{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &mine), 0);
  if (mine.rlim_max != RLIM_INFINITY && mine.rlim_max <= 256)
    GTEST_SKIP() << "the hard limit of open files here is " << mine.rlim_max;
  rlimit low = mine;
  low.rlim_cur = 256;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  ServeFixture f;  // the server inherits the soft limit of 256
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &mine), 0);
  ASSERT_FALSE(f.address.empty()) << f.srv->log();
  const auto info = nlohmann::json::parse(file_read(f.tmp.path + "/srv/server.json"));
  std::ifstream limits("/proc/" + std::to_string(info["pid"].get<int64_t>()) + "/limits");
  std::string line, soft;
  while (std::getline(limits, line))
    if (line.rfind("Max open files", 0) == 0) std::istringstream(line.substr(14)) >> soft;
  const uint64_t expected = mine.rlim_max == RLIM_INFINITY ? (1u << 20) : mine.rlim_max;
  EXPECT_EQ(soft, std::to_string(expected));
  EXPECT_TRUE(f.srv->saw("up to " + std::to_string(expected) + " open descriptors"))
      << f.srv->log();
}

TEST(TransportSecurityServer, StatusNeedsTheReadTokenOffLoopback) {
  TempDir keys;
  write_secret(keys.path + "/read.token", "read-token-0123456789abcdef\n", kPrivate);
  ServeFixture f({{"--insecure", "--read-token-file", keys.path + "/read.token"}, "0.0.0.0:0"});
  ASSERT_FALSE(f.address.empty()) << f.srv->log();
  EXPECT_TRUE(f.srv->saw("WITHOUT TLS")) << f.srv->log();
  const std::string local = "127.0.0.1:" + f.address.substr(f.address.rfind(':') + 1);
  Proc refused("status", {SPES_BINARY, "status", "--server", local});
  ASSERT_TRUE(pump_until({&refused}, [&] { return refused.exited; }, 60));
  EXPECT_NE(refused.code, 0);
  EXPECT_TRUE(refused.saw("read token")) << refused.log();
  Proc ok("status", {SPES_BINARY, "status", "--server", local, "--read-token-file",
                     keys.path + "/read.token", "--json"});
  ASSERT_TRUE(pump_until({&ok}, [&] { return ok.exited; }, 60));
  EXPECT_EQ(ok.code, 0) << ok.log() << f.srv->log();
  EXPECT_TRUE(ok.saw("\"published_round\": 0")) << ok.log();
}

TEST(TransportSecurityServer, ClientCertificatesAreBoundToNodeIds) {
  // A CA, a server certificate for 127.0.0.1 and client certificates named node0 and node1,
  // made by openssl for this test.
  TempDir keys;
  const std::string k = keys.path + "/";
  const std::vector<std::vector<std::string>> steps = {
      {"req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=spes-ca",
       "-keyout", k + "ca.key", "-out", k + "ca.pem"},
      {"req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout",
       k + "server.key", "-out", k + "server.csr"},
      {"req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=node0", "-keyout", k + "node0.key",
       "-out", k + "node0.csr"},
      {"req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=node1", "-keyout", k + "node1.key",
       "-out", k + "node1.csr"}};
  for (const auto& s : steps) {
    std::vector<std::string> argv = {"/usr/bin/openssl"};
    argv.insert(argv.end(), s.begin(), s.end());
    Proc p("openssl", argv);
    ASSERT_TRUE(pump_until({&p}, [&] { return p.exited; }, 120));
    ASSERT_EQ(p.code, 0) << p.log();
  }
  std::ofstream(k + "san.ext") << "subjectAltName=DNS:localhost,IP:127.0.0.1\n";
  int serial = 1;
  for (const std::string name : {"server", "node0", "node1"}) {
    std::vector<std::string> argv = {"/usr/bin/openssl", "x509", "-req", "-in", k + name + ".csr",
                                     "-CA", k + "ca.pem", "-CAkey", k + "ca.key",
                                     "-set_serial", std::to_string(serial++), "-days", "1",
                                     "-out", k + name + ".pem"};
    if (name == "server") argv.insert(argv.end(), {"-extfile", k + "san.ext"});
    Proc p("openssl", argv);
    ASSERT_TRUE(pump_until({&p}, [&] { return p.exited; }, 120));
    ASSERT_EQ(p.code, 0) << p.log();
  }
  ServeFixture f({{"--bind-client-certs"}, "127.0.0.1:0",
                  "  tls_cert: " + k + "server.pem\n  tls_key: " + k + "server.key\n"
                  "  tls_client_ca: " + k + "ca.pem\n"});
  ASSERT_FALSE(f.address.empty()) << f.srv->log();
  auto call_as = [&](const std::string& cert) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = file_read(k + "ca.pem");
    ssl.pem_cert_chain = file_read(k + cert + ".pem");
    ssl.pem_private_key = file_read(k + cert + ".key");
    auto stub = pb::SpesSync::NewStub(grpc::CreateChannel(f.address, grpc::SslCredentials(ssl)));
    pb::NodeIdentity body;
    body.set_node_id(0);
    body.set_incarnation(1);
    return heartbeat(*stub, 0, kToken0, body);
  };
  // Node 0's token with node 1's certificate is refused; with its own it gets as far as
  // membership (it has not joined).
  const grpc::Status wrong = call_as("node1");
  EXPECT_EQ(wrong.error_code(), grpc::StatusCode::PERMISSION_DENIED) << wrong.error_message();
  EXPECT_THAT(wrong.error_message(), HasSubstr("does not name 'node0'"));
  const grpc::Status own = call_as("node0");
  EXPECT_EQ(own.error_code(), grpc::StatusCode::NOT_FOUND) << own.error_message();
}
