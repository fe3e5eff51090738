// The sync server's live status page over HTTP (a small HTTP/1.x server of its own): GET /
// serves one self-contained page (inline CSS and JavaScript, no external scripts or fonts, so it
// works without internet) that polls GET /api/status every two seconds and redraws the nodes,
// the rounds, loss curves per node and per-layer expert similarity; GET /api/status returns the
// JSON that `status` builds at the time of the request. Runs on its own thread. Every request
// must name an allowed host in its Host header (421 otherwise: a defence against DNS
// rebinding), and /api/status may require a read token (`Authorization: Bearer TOKEN`; the
// page takes it from its URL fragment, `#token=TOKEN`, and 401 without it). A hostile client
// costs little (issue 35, finding 5): only GET and HEAD (405 otherwise), no request body (413,
// answered before any of it is read), a request head of at most 16 KiB (431) that must be
// complete 5 s after the connection opened (408: a client sending a byte every few seconds is
// cut), replies written within 10 s, one request per connection, and at most 32 connections
// open, 4 from one address (503 at once past either; common/connection_guard.h). The accept
// loop never stops on an error (out of descriptors: it waits and accepts again). Leaves out:
// TLS.
#pragma once
#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <string>

namespace spes::dashboard {

// Who may use the page. Null functions: any Host, no token.
struct DashboardAccess {
  std::function<bool(const std::string& host)> host_allowed;  // lower case, no port/brackets
  std::function<bool(const std::string& token)> token_ok;     // null: /api/status needs none
};

// The host of an HTTP Host header value, lower case, without port or IPv6 brackets.
std::string host_header_name(const std::string& value);

class DashboardServer {
 public:
  // Binds host:port (port 0: any free port) and starts serving; fails with a clear error when
  // the address cannot be bound.
  DashboardServer(const std::string& host, int port, std::function<nlohmann::json()> status,
                  DashboardAccess access = {});
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
