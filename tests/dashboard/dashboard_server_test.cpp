// The dashboard's HTTP server: the page and the status JSON over a real loopback socket (a raw
// HTTP/1.0 request, independent of the server's library), errors from the status provider, a
// clear error for a port already taken, the Host check (DNS rebinding) and the read token. The page itself is checked in headless Chromium by
// scripts/test_dashboard.sh (CTest: dashboard_headless_chromium).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "spes/common/error.h"
#include "spes/dashboard/dashboard_server.h"

namespace spes::dashboard {
namespace {

// `host`: the Host header ("" sends none); `authorization`: an Authorization header if set.
std::string http_get(int port, const std::string& path, const std::string& host = "127.0.0.1",
                     const std::string& authorization = "") {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  std::string req = "GET " + path + " HTTP/1.0\r\n";
  if (!host.empty()) req += "Host: " + host + "\r\n";
  if (!authorization.empty()) req += "Authorization: " + authorization + "\r\n";
  req += "\r\n";
  EXPECT_EQ(::send(fd, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) out.append(buf, n);
  ::close(fd);
  return out;
}

int status_of(const std::string& response) {
  return response.rfind("HTTP/1.", 0) == 0 && response.size() > 12 ? std::atoi(&response[9]) : 0;
}

std::string body_of(const std::string& response) {
  const size_t p = response.find("\r\n\r\n");
  return p == std::string::npos ? "" : response.substr(p + 4);
}

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

}  // namespace
}  // namespace spes::dashboard
