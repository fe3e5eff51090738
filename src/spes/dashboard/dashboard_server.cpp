// HTTP status page of the sync server (see dashboard_server.h). Compiled with the defines of
// Debian's cpp-httplib build (CMakeLists.txt) so its class layouts match the shared library.
#include "spes/dashboard/dashboard_server.h"

#include <httplib.h>
#include <spdlog/spdlog.h>

#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <thread>

#include "spes/common/error.h"

namespace spes::dashboard {

struct DashboardServer::Impl {
  httplib::Server http;
  std::thread thread;
  std::string host;
  int port = 0;
};

std::string host_header_name(const std::string& value) {
  std::string h = value;
  if (!h.empty() && h[0] == '[') {
    const size_t close = h.find(']');
    h = close == std::string::npos ? h : h.substr(1, close - 1);
  } else if (std::count(h.begin(), h.end(), ':') == 1) {
    h = h.substr(0, h.find(':'));
  }
  std::transform(h.begin(), h.end(), h.begin(), [](unsigned char c) { return std::tolower(c); });
  return h;
}

DashboardServer::DashboardServer(const std::string& host, int port,
                                 std::function<nlohmann::json()> status, DashboardAccess access)
    : impl_(std::make_unique<Impl>()) {
  impl_->host = host;
  // httplib's default also sets SO_REUSEPORT, which would let a second server share a port
  // already in use instead of failing; keep only SO_REUSEADDR (quick restarts).
  impl_->http.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // Before any route: a page served under a name the user did not configure (DNS rebinding)
  // gets nothing.
  impl_->http.set_pre_routing_handler([access](const httplib::Request& req,
                                               httplib::Response& res) {
    const std::string name = host_header_name(req.get_header_value("Host"));
    if (name.empty() || (access.host_allowed && !access.host_allowed(name))) {
      res.status = 421;
      res.set_content("unknown Host: use an IP address, localhost or "
                      "spes_config.dashboard_host\n", "text/plain");
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  impl_->http.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(dashboard_page_html(), "text/html; charset=utf-8");
  });
  impl_->http.Get("/api/status", [status, access](const httplib::Request& req,
                                                  httplib::Response& res) {
    res.set_header("Cache-Control", "no-store");
    if (access.token_ok) {
      const std::string auth = req.get_header_value("Authorization");
      const std::string bearer = "Bearer ";
      if (auth.rfind(bearer, 0) != 0 || !access.token_ok(auth.substr(bearer.size()))) {
        res.status = 401;
        res.set_content(nlohmann::json{{"error", "read token required: open the page as "
                                                 "http://HOST:PORT/#token=READ_TOKEN (spes serve "
                                                 "--read-token-file)"}}.dump(),
                        "application/json");
        return;
      }
    }
    try {
      res.set_content(status().dump(), "application/json");
    } catch (const std::exception& e) {
      res.status = 500;
      res.set_content(nlohmann::json{{"error", e.what()}}.dump(), "application/json");
    }
  });
  if (port == 0) {
    impl_->port = impl_->http.bind_to_any_port(host);
  } else {
    impl_->port = impl_->http.bind_to_port(host, port) ? port : -1;
  }
  SPES_CHECK(impl_->port > 0, "dashboard: cannot listen on {}:{} (is the port in use? set "
             "spes_config.dashboard_port to another port, or 0 for any free port)", host, port);
  impl_->thread = std::thread([this] { impl_->http.listen_after_bind(); });
  // stop() only ends a loop that is already running: wait for it, so that a server destroyed
  // right after construction does not leave its thread listening forever.
  for (int i = 0; i < 5000 && !impl_->http.is_running(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  spdlog::info("dashboard: {}", url());
}

DashboardServer::~DashboardServer() {
  impl_->http.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

int DashboardServer::port() const { return impl_->port; }

std::string DashboardServer::url() const {
  return fmt::format("http://{}:{}/", impl_->host, impl_->port);
}

}  // namespace spes::dashboard
