// The sync server's live status page over HTTP (cpp-httplib, Debian's libcpp-httplib): GET /
// serves one self-contained page (inline CSS and JavaScript, no external scripts or fonts, so it
// works without internet) that polls GET /api/status every two seconds and redraws the nodes,
// the rounds, loss curves per node and per-layer expert similarity; GET /api/status returns the
// JSON that `status` builds at the time of the request. Runs on its own thread.
#pragma once
#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <string>

namespace spes::dashboard {

class DashboardServer {
 public:
  // Binds host:port (port 0: any free port) and starts serving; fails with a clear error when
  // the address cannot be bound.
  DashboardServer(const std::string& host, int port, std::function<nlohmann::json()> status);
  ~DashboardServer();  // stops serving
  DashboardServer(const DashboardServer&) = delete;
  DashboardServer& operator=(const DashboardServer&) = delete;
  int port() const;
  std::string url() const;  // http://host:port/

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The page as served (exposed for tests).
const char* dashboard_page_html();

}  // namespace spes::dashboard
