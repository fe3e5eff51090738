// The dashboard's HTTP server: the page and the status JSON over a real loopback socket (a raw
// HTTP/1.0 request, independent of the server's library), errors from the status provider, and
// a clear error for a port already taken. The page itself is checked in headless Chromium by
// scripts/test_dashboard.sh (CTest: dashboard_headless_chromium).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>

#include "spes/common/error.h"
#include "spes/dashboard/dashboard_server.h"

namespace spes::dashboard {
namespace {

std::string http_get(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  EXPECT_EQ(::send(fd, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) out.append(buf, n);
  ::close(fd);
  return out;
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

}  // namespace
}  // namespace spes::dashboard
