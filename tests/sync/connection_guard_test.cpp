// The connection guard in front of the sync server's gRPC port (issue 35, finding 2;
// common/guarded_listener.h): idle connections from one stranger are cut at the per-address
// limit while honest rounds go on; a flood far past the server's descriptor limit leaves room
// for the nodes and ends with the server accepting again; connections without the HTTP/2
// preface within the handshake timeout, or without traffic for the idle timeout, are closed.
// Real `spes serve` processes on loopback; strangers are raw sockets from other 127.0.0.x
// addresses, honest nodes SyncClients from 127.0.0.1. Also ConnectionGuard's reserved room.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "spes/common/connection_guard.h"
#include "spes/sync/node/client.h"
#include "sync/raw_connection.h"
#include "sync/serve_fixture.h"
#include "sync/sync_process_util.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;

namespace {

const std::string kPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

int port_of(const std::string& address) { return std::stoi(address.substr(address.rfind(':') + 1)); }

// Nodes 0 and 1 of a ServeFixture's run, from 127.0.0.1: each round both upload a small
// change of the published model (the same one a RoundState of this process publishes).
struct HonestNodes {
  TempDir dir;
  RoundState ref;
  std::vector<std::unique_ptr<FakeNode>> nodes;
  bool joined = false;
  explicit HonestNodes(const ServeFixture& f) : ref(f.cfg, ServeOptions{dir.path}) {
    for (int i = 0; i < 2; ++i) {
      nodes.push_back(std::make_unique<FakeNode>(f.cfg, i, 20 + i));
      nodes.back()->id.auth_token = ServeFixture::token(i);
      ref.join(nodes.back()->join_info());
    }
  }
  // Round `round` through the server at `address`; its state once published (or waited for).
  RoundStatus round(const std::string& address, int64_t round) {
    std::vector<SafetensorsStreamWriter> uploads;
    for (size_t i = 0; i < nodes.size(); ++i)
      uploads.push_back(upload_of(*nodes[i], round, trained(*nodes[i], ref, 0.001 * (i + 1))));
    for (size_t i = 0; i < nodes.size(); ++i) send_upload(ref, nodes[i]->id, round, uploads[i]);
    for (size_t i = 0; i < nodes.size(); ++i) {
      SyncClient c(address, nodes[i]->id);
      if (!joined) retried([&] { return c.join(nodes[i]->join_info()); }, 30);
      EXPECT_TRUE(retried([&] { return c.upload(round, round * 10, uploads[i]); }, 30).accepted);
    }
    joined = true;
    SyncClient w(address, nodes[0]->id);
    return retried([&] { return w.wait_round(round, 30000); }, 30);
  }
};

// A Status call on a connection of its own (a new TCP connection through the guard).
grpc::Status status_on_new_connection(const ServeFixture& f) {
  grpc::ClientContext ctx;
  set_deadline(ctx, 20);
  v1::StatusRequest req;
  v1::StatusReply rep;
  return f.stub(/*own_connection=*/true)->Status(&ctx, req, &rep);
}

}  // namespace

TEST(ConnectionGuard, RoomIsKeptForKnownAddressesWhichTheAddressLimitDoesNotHold) {
  ConnectionGuard g(ConnectionLimits{6, 2, 3});
  std::string why;
  std::vector<std::unique_ptr<ConnectionGuard::Ticket>> t;
  t.push_back(g.admit("10.0.0.1", &why));
  t.push_back(g.admit("10.0.0.1", &why));
  EXPECT_EQ(g.admit("10.0.0.1", &why), nullptr);  // its per-address limit
  EXPECT_NE(why.find("the most one address may hold"), std::string::npos) << why;
  t.push_back(g.admit("10.0.0.2", &why));
  EXPECT_EQ(g.admit("10.0.0.3", &why), nullptr);  // 3 of 6 open: the rest is reserved
  EXPECT_NE(why.find("does not know"), std::string::npos) << why;
  for (int i = 0; i < 3; ++i) t.push_back(g.admit("10.0.0.9", &why, /*known=*/true));
  for (const auto& x : t) EXPECT_NE(x, nullptr);
  EXPECT_EQ(g.admit("10.0.0.9", &why, true), nullptr);  // the total holds for everyone
  t.clear();
  EXPECT_EQ(g.open(), 0);
}

// ~1,100 idle connections from one stranger made honest uploads fail. Now the guard closes a
// stranger's connections past its per-address limit at once, and the round completes.
TEST(ConnectionGuardServer, IdleConnectionsFromOneAddressAreCutAtItsLimitAndRoundsGoOn) {
  ServeFixture f({{"--max-connections-per-address", "8", "--handshake-timeout", "300"}});
  ASSERT_FALSE(f.address.empty()) << f.srv->log();
  RawSockets flood;
  for (int i = 0; i < 40; ++i) {
    flood.fds.push_back(connect_from("127.0.0.2", port_of(f.address)));
    ASSERT_GE(flood.fds.back(), 0);
  }
  EXPECT_EQ(count_closed(flood.fds, 32, 30), 32) << f.srv->log();
  EXPECT_EQ(count_closed(flood.fds, 33, 1), 32);  // the 8 within the limit stay open
  HonestNodes honest(f);
  EXPECT_TRUE(honest.round(f.address, 1).published) << f.srv->log();
  EXPECT_FALSE(f.srv->poll()) << f.srv->log();
}

// gRPC 1.51 holds any number of connections, and its accept loop can stop when descriptors run
// out (CVE-2023-4785). With the server under `prlimit --nofile=256`, a flood of 600 held
// connections from 10 addresses: the guard keeps its total where descriptors last, with room
// for the nodes' address (known once they joined), so a round completes during the flood and a
// new connection from the nodes' address is served; after the flood new connections are
// accepted and rounds complete again.
TEST(ConnectionGuardServer, AFloodPastTheDescriptorLimitLeavesRoomForNodesAndEnds) {
  rlimit mine{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &mine), 0);
  if (mine.rlim_max != RLIM_INFINITY && mine.rlim_max < 1024)
    GTEST_SKIP() << "the hard limit of open files here is " << mine.rlim_max;
  if (mine.rlim_cur < 1024) {
    rlimit raised = mine;
    raised.rlim_cur = 1024;
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &raised), 0);
  }
  ServeSetup setup;
  setup.wrapper = {"/usr/bin/prlimit", "--nofile=256", "--"};
  ServeFixture f(setup);
  ASSERT_FALSE(f.address.empty()) << f.srv->log();
  HonestNodes honest(f);
  ASSERT_TRUE(honest.round(f.address, 1).published) << f.srv->log();
  RawSockets flood;
  for (int i = 0; i < 600; ++i) {
    const int fd = connect_from("127.0.0." + std::to_string(2 + i % 10), port_of(f.address));
    if (fd >= 0) flood.fds.push_back(fd);
  }
  EXPECT_GE(flood.fds.size(), 590u);
  EXPECT_TRUE(status_on_new_connection(f).ok()) << f.srv->log();
  EXPECT_TRUE(honest.round(f.address, 2).published) << f.srv->log();
  flood.close_all();
  const grpc::Status after = status_on_new_connection(f);
  EXPECT_TRUE(after.ok()) << after.error_message() << f.srv->log();
  EXPECT_TRUE(honest.round(f.address, 3).published) << f.srv->log();
  EXPECT_FALSE(f.srv->poll()) << f.srv->log();
  EXPECT_TRUE(f.srv->saw("connection guard: 1024 connections would need more descriptors"))
      << f.srv->log();
}

// A connection that sends nothing (half-open) is closed after the handshake timeout, one that
// sends something other than HTTP/2 at once, and one that spoke HTTP/2 and then went silent
// after the idle timeout (short test timeouts: 1 s and 3 s).
TEST(ConnectionGuardServer, HalfOpenAndIdleConnectionsAreClosedAfterTheirTimeouts) {
  ServeFixture f({{"--handshake-timeout", "1", "--idle-connection-timeout", "3"}});
  ASSERT_FALSE(f.address.empty()) << f.srv->log();
  const int port = port_of(f.address);
  RawSockets s;
  const int silent = connect_from("127.0.0.2", port);
  const int garbage = connect_from("127.0.0.3", port);
  const int idle = connect_from("127.0.0.4", port);
  s.fds = {silent, garbage, idle};
  for (int fd : s.fds) ASSERT_GE(fd, 0);
  const std::string get = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(::send(garbage, get.data(), get.size(), MSG_NOSIGNAL), static_cast<ssize_t>(get.size()));
  // The preface and an empty SETTINGS frame: gRPC answers with its own SETTINGS.
  const std::string hello = kPreface + std::string("\0\0\0\x04\0\0\0\0\0", 9);
  ASSERT_EQ(::send(idle, hello.data(), hello.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(hello.size()));
  EXPECT_TRUE(closed_by_server(garbage, 30)) << f.srv->log();
  EXPECT_TRUE(closed_by_server(silent, 30)) << f.srv->log();
  std::string answer;
  EXPECT_TRUE(closed_by_server(idle, 60, &answer)) << f.srv->log();
  ASSERT_GE(answer.size(), 9u) << "gRPC never answered the preface";
  EXPECT_EQ(answer[3], '\x04');  // its first frame: SETTINGS
  // The server still serves new connections.
  EXPECT_TRUE(status_on_new_connection(f).ok()) << f.srv->log();
}
