// The dashboard's HTTP server: the page and the status JSON over a real loopback socket (a raw
// HTTP/1.0 request, independent of the server's library), errors from the status provider, a
// clear error for a port already taken, the Host check (DNS rebinding) and the read token; only
// GET and HEAD, no body read, slow clients cut at the head deadline and connections capped in
// total and per address (raw sockets from distinct 127.0.0.x addresses). The page itself is
// checked in headless Chromium by
// scripts/test_dashboard.sh (CTest: dashboard_headless_chromium).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "spes/common/error.h"
#include "dashboard/http_get.h"
#include "spes/dashboard/dashboard_server.h"

namespace spes::dashboard {
namespace {

using testing::body_of;
using testing::http_get;
using testing::status_of;

TEST(DashboardServer, ServesThePageAndTheLiveStatus) {
  std::atomic<int> calls{0};
  DashboardServer server("127.0.0.1", 0, [&] {
    return nlohmann::json{{"published_round", ++calls}, {"nodes", nlohmann::json::array()}};
  });
  ASSERT_GT(server.port(), 0);
  const std::string page = http_get(server.port(), "/");
  EXPECT_NE(page.find("200 OK"), std::string::npos);
  EXPECT_NE(page.find("text/html"), std::string::npos);
  EXPECT_EQ(body_of(page), dashboard_page_html());
  // Self-contained: no external scripts, styles or fonts.
  EXPECT_EQ(body_of(page).find("src=\"http"), std::string::npos);
  EXPECT_EQ(body_of(page).find("href=\"http"), std::string::npos);
  // Each request asks the provider again (live).
  EXPECT_EQ(nlohmann::json::parse(body_of(http_get(server.port(), "/api/status")))
                .at("published_round"), 1);
  EXPECT_EQ(nlohmann::json::parse(body_of(http_get(server.port(), "/api/status")))
                .at("published_round"), 2);
  EXPECT_NE(http_get(server.port(), "/nope").find("404"), std::string::npos);
}

TEST(DashboardServer, ProviderErrorsBecomeA500WithTheMessage) {
  DashboardServer server("127.0.0.1", 0, []() -> nlohmann::json { fail("state unavailable"); });
  const std::string r = http_get(server.port(), "/api/status");
  EXPECT_NE(r.find("500"), std::string::npos);
  EXPECT_EQ(nlohmann::json::parse(body_of(r)).at("error"), "state unavailable");
}

TEST(DashboardServer, APortInUseIsOneClearError) {
  DashboardServer first("127.0.0.1", 0, [] { return nlohmann::json::object(); });
  try {
    DashboardServer second("127.0.0.1", first.port(), [] { return nlohmann::json::object(); });
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(first.port())), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("dashboard_port"), std::string::npos);
  }
}

TEST(DashboardServer, ChecksTheHostHeaderAndTheReadToken) {
  DashboardAccess access;
  access.host_allowed = [](const std::string& h) {
    return h == "localhost" || h == "spes.example" || h == "127.0.0.1" || h == "::1";
  };
  DashboardServer page("127.0.0.1", 0, [] { return nlohmann::json{{"ok", 1}}; }, access);
  const int p = page.port();
  const std::string port = ":" + std::to_string(p);
  EXPECT_EQ(status_of(http_get(p, "/api/status", "127.0.0.1" + port)), 200);
  EXPECT_EQ(status_of(http_get(p, "/api/status", "localhost" + port)), 200);
  EXPECT_EQ(status_of(http_get(p, "/", "SPES.example" + port)), 200);
  EXPECT_EQ(status_of(http_get(p, "/api/status", "[::1]" + port)), 200);
  // DNS rebinding: a name of the attacker's that resolves to this machine.
  EXPECT_EQ(status_of(http_get(p, "/api/status", "rebind.attacker.example" + port)), 421);
  EXPECT_EQ(status_of(http_get(p, "/", "127.evil.com" + port)), 421);
  EXPECT_EQ(status_of(http_get(p, "/api/status", "")), 421);
  // With a read token, /api/status needs it (the page itself holds no data).
  access.token_ok = [](const std::string& t) { return t == "read-token-0123456789"; };
  DashboardServer locked("127.0.0.1", 0, [] { return nlohmann::json{{"ok", 1}}; }, access);
  const int q = locked.port();
  const std::string host = "127.0.0.1:" + std::to_string(q);
  EXPECT_EQ(status_of(http_get(q, "/api/status", host)), 401);
  EXPECT_EQ(status_of(http_get(q, "/api/status", host, "Bearer wrong-token-0123456789")), 401);
  const std::string ok = http_get(q, "/api/status", host, "Bearer read-token-0123456789");
  EXPECT_EQ(status_of(ok), 200);
  EXPECT_EQ(body_of(ok), "{\"ok\":1}");
  EXPECT_EQ(status_of(http_get(q, "/", host)), 200);
}

// A connected socket to 127.0.0.1:port from the loopback address `from` (127.0.0.x: distinct
// source addresses on one machine).
int connect_from(int port, const std::string& from) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in src{};
  src.sin_family = AF_INET;
  ::inet_pton(AF_INET, from.c_str(), &src.sin_addr);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof(src)), 0) << from;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  return fd;
}

// Sends `request` (as much as the peer takes) and reads the reply until the server closes.
std::string send_and_read(int fd, const std::string& request) {
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) out.append(buf, n);
  ::close(fd);
  return out;
}

std::string http_get_from(int port, const std::string& from) {
  return send_and_read(connect_from(port, from), "GET /api/status HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
}

// Issue 35, finding 5: the page read a 512 MiB POST body (RSS grew about 1 GiB). Now only GET
// and HEAD are served, and a request with a body is answered before its body is read.
TEST(DashboardServer, OnlyGetAndHeadAndNoBodyIsRead) {
  DashboardServer page("127.0.0.1", 0, [] { return nlohmann::json{{"ok", 1}}; });
  const int p = page.port();
  const std::string host = "Host: 127.0.0.1\r\n";
  // A 512 MiB body announced; 1 MiB of it sent: the reply comes without the rest.
  const int fd = connect_from(p, "127.0.0.1");
  const std::string head = "POST /api/status HTTP/1.1\r\n" + host +
                           "Content-Length: 536870912\r\n\r\n";
  EXPECT_EQ(status_of(send_and_read(fd, head + std::string(1 << 20, 'x'))), 405);
  EXPECT_EQ(status_of(send_and_read(connect_from(p, "127.0.0.1"),
                               "PUT / HTTP/1.1\r\n" + host + "\r\n")), 405);
  EXPECT_EQ(status_of(send_and_read(connect_from(p, "127.0.0.1"),
                               "GET /api/status HTTP/1.1\r\n" + host +
                                   "Content-Length: 100\r\n\r\n")), 413);
  const std::string h = send_and_read(connect_from(p, "127.0.0.1"), "HEAD / HTTP/1.1\r\n" + host +
                                                                   "\r\n");
  EXPECT_EQ(status_of(h), 200);
  EXPECT_EQ(body_of(h), "");
  // A head larger than 16 KiB.
  EXPECT_EQ(status_of(send_and_read(connect_from(p, "127.0.0.1"),
                               "GET / HTTP/1.1\r\n" + host + "X-Big: " +
                                   std::string(20000, 'a') + "\r\n\r\n")), 431);
}

// Slow clients (a header byte every second, from three addresses, more of them than the old
// server had threads) neither keep others from being served nor stay past the head deadline
// (5 s: answered 408); a fifth connection from one address, or past the total, is refused with
// 503 at once, and once the flood is gone every connection is served again.
TEST(DashboardServer, SlowClientsAreCutAndConnectionsAreCapped) {
  DashboardServer page("127.0.0.1", 0, [] { return nlohmann::json{{"ok", 1}}; });
  const int p = page.port();
  std::vector<int> slow;
  for (const char* from : {"127.0.0.3", "127.0.0.4", "127.0.0.5"})
    for (int i = 0; i < 4; ++i) {
      slow.push_back(connect_from(p, from));
      const std::string start = "GET /api/status HTTP/1.1\r\nHost: 127.0.0.1\r\n";
      ::send(slow.back(), start.data(), start.size(), MSG_NOSIGNAL);
    }
  std::atomic<bool> done{false};
  std::thread trickle([&] {
    for (int s = 0; s < 30 && !done; ++s) {
      for (int fd : slow) ::send(fd, "X", 1, MSG_NOSIGNAL);
      std::this_thread::sleep_for(std::chrono::seconds(1));
    }
  });
  // Another client is served while they trickle.
  EXPECT_EQ(status_of(http_get_from(p, "127.0.0.2")), 200);
  // A fifth connection from a trickling address is refused at once.
  const std::string refused = send_and_read(connect_from(p, "127.0.0.3"),
                                       "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
  EXPECT_EQ(status_of(refused), 503);
  EXPECT_NE(refused.find("from 127.0.0.3"), std::string::npos) << refused;
  // The slow ones are answered 408 at their head deadline and closed.
  for (int fd : slow) {
    std::string out;
    char buf[4096];
    for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) out.append(buf, n);
    EXPECT_EQ(status_of(out), 408) << out;
    ::close(fd);
  }
  done = true;
  trickle.join();
  // The total cap: 32 idle connections from 8 addresses, then a 33rd from a ninth is refused.
  std::vector<int> idle;
  for (int a = 10; a < 18; ++a)
    for (int i = 0; i < 4; ++i) idle.push_back(connect_from(p, "127.0.0." + std::to_string(a)));
  // Once the server has taken all of them, a 33rd from a ninth address is refused.
  int probe = 0;
  for (int i = 0; i < 50 && (probe = status_of(http_get_from(p, "127.0.0.20"))) != 503; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(probe, 503);
  for (int fd : idle) ::close(fd);
  // Accepting again after the flood.
  for (int i = 0; i < 50 && status_of(http_get_from(p, "127.0.0.20")) != 200; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(status_of(http_get_from(p, "127.0.0.20")), 200);
}

}  // namespace
}  // namespace spes::dashboard
