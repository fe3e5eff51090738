// HTTP status page of the sync server (see dashboard_server.h): a small HTTP/1.x server of its
// own, so that every limit is decided here before a request costs anything (issue 35, finding
// 5: the library it replaced read a 512 MiB POST body, and one client sending a header byte
// every few seconds kept /api/status from answering others).
#include "spes/dashboard/dashboard_server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "spes/common/connection_guard.h"
#include "spes/common/error.h"

namespace spes::dashboard {

namespace {

using Clock = std::chrono::steady_clock;

// A request head larger than this, or not complete this soon after the connection opened, is
// answered 431 / 408 and the connection closed; writing the reply has its own deadline.
constexpr size_t kMaxHeadBytes = 16 * 1024;
constexpr double kHeadDeadlineS = 5.0;
constexpr double kWriteDeadlineS = 10.0;

struct Reply {
  int status = 200;
  std::string type = "text/plain", body;
  std::vector<std::pair<std::string, std::string>> headers;
};

const char* reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Content Too Large";
    case 421: return "Misdirected Request";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    default: return "Error";
  }
}

double seconds_left(Clock::time_point deadline) {
  return std::chrono::duration<double>(deadline - Clock::now()).count();
}

// Writes all of `data` before `deadline` (false: the peer is too slow or gone).
bool write_all(int fd, const std::string& data, Clock::time_point deadline) {
  size_t done = 0;
  while (done < data.size()) {
    const double left = seconds_left(deadline);
    if (left <= 0) return false;
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, static_cast<int>(left * 1000) + 1) <= 0) return false;
    const ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

void send_reply(int fd, const Reply& r, bool head_only) {
  std::string out = fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n"
                                "Connection: close\r\n", r.status, reason(r.status), r.type,
                                r.body.size());
  for (const auto& [k, v] : r.headers) out += k + ": " + v + "\r\n";
  out += "\r\n";
  if (!head_only) out += r.body;
  write_all(fd, out, Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(kWriteDeadlineS)));
}

Reply plain(int status, const std::string& text) {
  Reply r;
  r.status = status;
  r.body = text;
  return r;
}

// Reads the request head (up to the blank line) before the deadline: 0 and the head, or the
// status to answer (408 too slow, 431 too large, 400 closed early).
int read_head(int fd, Clock::time_point deadline, std::string* head) {
  char buf[4096];
  while (head->find("\r\n\r\n") == std::string::npos) {
    if (head->size() > kMaxHeadBytes) return 431;
    const double left = seconds_left(deadline);
    if (left <= 0) return 408;
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(left * 1000) + 1);
    if (ready == 0) return 408;
    if (ready < 0) return 400;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return 400;
    head->append(buf, static_cast<size_t>(n));
  }
  return head->find("\r\n\r\n") > kMaxHeadBytes ? 431 : 0;
}

// Reads and drops what the client still sends (a body it was told not to send, the rest of a
// slow head) for up to 2 s and 4 MiB, until it closes: closing with unread bytes would reset
// the connection, and the client could lose the reply.
void linger_close(int fd) {
  const auto until = Clock::now() + std::chrono::seconds(2);
  char buf[4096];
  for (size_t drained = 0; drained < (4u << 20);) {
    const double left = seconds_left(until);
    if (left <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left * 1000) + 1) <= 0) break;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    drained += static_cast<size_t>(n);
  }
}

struct Request {
  std::string method, path;
  std::map<std::string, std::string> headers;  // names in lower case
};

// Parses a request head; false when it is not HTTP/1.x.
bool parse_head(const std::string& head, Request* r) {
  const size_t eol = head.find("\r\n");
  const std::string line = head.substr(0, eol);
  const size_t a = line.find(' '), b = line.rfind(' ');
  if (a == std::string::npos || b == a || line.compare(b + 1, 7, "HTTP/1.") != 0) return false;
  r->method = line.substr(0, a);
  r->path = line.substr(a + 1, b - a - 1);
  r->path = r->path.substr(0, r->path.find('?'));
  size_t at = eol + 2;
  while (at < head.size()) {
    const size_t end = head.find("\r\n", at);
    if (end == std::string::npos || end == at) break;
    const std::string h = head.substr(at, end - at);
    const size_t colon = h.find(':');
    if (colon != std::string::npos) {
      std::string name = h.substr(0, colon);
      std::transform(name.begin(), name.end(), name.begin(),
                     [](unsigned char c) { return std::tolower(c); });
      size_t v = colon + 1;
      while (v < h.size() && (h[v] == ' ' || h[v] == '\t')) ++v;
      r->headers[name] = h.substr(v);
    }
    at = end + 2;
  }
  return true;
}

std::string header(const Request& r, const std::string& name) {
  const auto it = r.headers.find(name);
  return it == r.headers.end() ? "" : it->second;
}

}  // namespace

struct DashboardServer::Impl {
  std::string host;
  int port = 0;
  int listen_fd = -1;
  std::function<nlohmann::json()> status;
  DashboardAccess access;
  ConnectionGuard guard{ConnectionLimits{32, 4}};
  std::atomic<bool> stopping{false};
  std::thread acceptor;
  std::mutex mu;
  std::condition_variable idle;
  std::set<int> open_fds;  // connections being served (shut down on stop)
  int64_t workers = 0;

  void accept_loop();
  void serve(int fd, std::unique_ptr<ConnectionGuard::Ticket> ticket);
  Reply answer(const Request& r) const;
};

void DashboardServer::Impl::accept_loop() {
  // Refused connections are answered 503 here and held for up to a second while what they
  // send is read and dropped (closing with unread bytes resets the connection before the
  // client reads the answer); at most 64 at once, the oldest closed first.
  struct Refused {
    int fd;
    Clock::time_point until;
  };
  std::vector<Refused> refused;
  auto drop = [&](size_t i) {
    ::close(refused[i].fd);
    refused.erase(refused.begin() + static_cast<std::ptrdiff_t>(i));
  };
  while (!stopping) {
    std::vector<pollfd> p{{listen_fd, POLLIN, 0}};
    for (const Refused& r : refused) p.push_back({r.fd, POLLIN, 0});
    ::poll(p.data(), p.size(), 200);
    const auto now = Clock::now();
    for (size_t i = refused.size(); i-- > 0;) {
      char buf[4096];
      const bool readable = p[i + 1].revents != 0;
      const ssize_t n = readable ? ::recv(refused[i].fd, buf, sizeof(buf), MSG_DONTWAIT) : 1;
      if ((readable && n <= 0) || now >= refused[i].until) drop(i);
    }
    if (!(p[0].revents & POLLIN)) continue;
    const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      // Out of descriptors (or a connection reset before it was taken): wait a little and go
      // on accepting; the loop never ends on an error.
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    std::string why;
    auto ticket = guard.admit(peer_address(fd), &why);
    if (!ticket) {
      send_reply(fd, plain(503, "too many connections: " + why + "\n"), false);
      ::shutdown(fd, SHUT_WR);
      if (refused.size() >= 64) drop(0);
      refused.push_back({fd, now + std::chrono::seconds(1)});
      continue;
    }
    std::lock_guard<std::mutex> lk(mu);
    open_fds.insert(fd);
    ++workers;
    std::thread([this, fd, t = std::move(ticket)]() mutable { serve(fd, std::move(t)); })
        .detach();
  }
  for (const Refused& r : refused) ::close(r.fd);
}

void DashboardServer::Impl::serve(int fd, std::unique_ptr<ConnectionGuard::Ticket> ticket) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(kHeadDeadlineS));
  std::string head;
  Request req;
  Reply reply;
  bool head_only = false;
  if (const int err = read_head(fd, deadline, &head)) {
    reply = plain(err, err == 408   ? "the request head took too long\n"
                       : err == 431 ? "the request head is too large\n"
                                    : "bad request\n");
  } else if (!parse_head(head, &req)) {
    reply = plain(400, "bad request\n");
  } else if (req.method != "GET" && req.method != "HEAD") {
    reply = plain(405, "only GET and HEAD\n");
    reply.headers.emplace_back("Allow", "GET, HEAD");
  } else if (!header(req, "transfer-encoding").empty() ||
             (!header(req, "content-length").empty() && header(req, "content-length") != "0")) {
    reply = plain(413, "this page takes no request body\n");
  } else {
    head_only = req.method == "HEAD";
    reply = answer(req);
  }
  if (!stopping) send_reply(fd, reply, head_only);
  ::shutdown(fd, SHUT_WR);
  linger_close(fd);
  ticket.reset();
  std::lock_guard<std::mutex> lk(mu);
  open_fds.erase(fd);
  ::close(fd);
  if (--workers == 0) idle.notify_all();
}

Reply DashboardServer::Impl::answer(const Request& req) const {
  // Before any route: a page served under a name the user did not configure (DNS rebinding)
  // gets nothing.
  const std::string name = host_header_name(header(req, "host"));
  if (name.empty() || (access.host_allowed && !access.host_allowed(name)))
    return plain(421, "unknown Host: use an IP address, localhost or "
                      "spes_config.dashboard_host\n");
  if (req.path == "/") {
    Reply r;
    r.type = "text/html; charset=utf-8";
    r.body = dashboard_page_html();
    return r;
  }
  if (req.path != "/api/status") return plain(404, "not found\n");
  Reply r;
  r.type = "application/json";
  r.headers.emplace_back("Cache-Control", "no-store");
  if (access.token_ok) {
    const std::string auth = header(req, "authorization");
    const std::string bearer = "Bearer ";
    if (auth.rfind(bearer, 0) != 0 || !access.token_ok(auth.substr(bearer.size()))) {
      r.status = 401;
      r.body = nlohmann::json{{"error", "read token required: open the page as "
                                        "http://HOST:PORT/#token=READ_TOKEN (spes serve "
                                        "--read-token-file)"}}.dump();
      return r;
    }
  }
  try {
    r.body = status().dump();
  } catch (const std::exception& e) {
    r.status = 500;
    r.body = nlohmann::json{{"error", e.what()}}.dump();
  }
  return r;
}

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
  impl_->status = std::move(status);
  impl_->access = std::move(access);
  impl_->listen_fd = listen_tcp(host, port, 64, &impl_->port);
  SPES_CHECK(impl_->listen_fd >= 0, "dashboard: cannot listen on {}:{} (is the port in use? set "
             "spes_config.dashboard_port to another port, or 0 for any free port)", host, port);
  impl_->acceptor = std::thread([this] { impl_->accept_loop(); });
  spdlog::info("dashboard: {}", url());
}

DashboardServer::~DashboardServer() {
  impl_->stopping = true;
  if (impl_->acceptor.joinable()) impl_->acceptor.join();
  ::close(impl_->listen_fd);
  std::unique_lock<std::mutex> lk(impl_->mu);
  for (int fd : impl_->open_fds) ::shutdown(fd, SHUT_RDWR);
  impl_->idle.wait(lk, [this] { return impl_->workers == 0; });
}

int DashboardServer::port() const { return impl_->port; }

std::string DashboardServer::url() const {
  return fmt::format("http://{}:{}/", impl_->host, impl_->port);
}

}  // namespace spes::dashboard
