// HTTP status page of the sync server (see dashboard_server.h). Compiled with the defines of
// Debian's cpp-httplib build (CMakeLists.txt) so its class layouts match the shared library.
#include "spes/dashboard/dashboard_server.h"

#include <httplib.h>
#include <spdlog/spdlog.h>

#include <sys/socket.h>

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

DashboardServer::DashboardServer(const std::string& host, int port,
                                 std::function<nlohmann::json()> status)
    : impl_(std::make_unique<Impl>()) {
  impl_->host = host;
  // httplib's default also sets SO_REUSEPORT, which would let a second server share a port
  // already in use instead of failing; keep only SO_REUSEADDR (quick restarts).
  impl_->http.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  impl_->http.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(dashboard_page_html(), "text/html; charset=utf-8");
  });
  impl_->http.Get("/api/status", [status](const httplib::Request&, httplib::Response& res) {
    try {
      res.set_content(status().dump(), "application/json");
    } catch (const std::exception& e) {
      res.status = 500;
      res.set_content(nlohmann::json{{"error", e.what()}}.dump(), "application/json");
    }
    res.set_header("Cache-Control", "no-store");
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
