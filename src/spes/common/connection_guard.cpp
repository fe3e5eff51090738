// Connection counts per source address and in total (see connection_guard.h).
#include "spes/common/connection_guard.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <unistd.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <fmt/core.h>

namespace spes {

ConnectionGuard::Ticket::~Ticket() { guard_.release(address_); }

std::unique_ptr<ConnectionGuard::Ticket> ConnectionGuard::admit(const std::string& address,
                                                                std::string* why,
                                                                bool known) {
  std::lock_guard<std::mutex> lk(mu_);
  int64_t& mine = per_address_[address];
  const int64_t total = known ? limits_.total : limits_.total - limits_.reserved;
  if (open_ >= total || (!known && mine >= limits_.per_address)) {
    if (why)
      *why = open_ >= total
                 ? fmt::format("{} connections are open, the most this server takes{}", open_,
                               known ? "" : " from addresses it does not know")
                 : fmt::format("{} connections from {} are open, the most one address may hold",
                               mine, address);
    if (mine == 0) per_address_.erase(address);
    return nullptr;
  }
  ++mine;
  ++open_;
  return std::unique_ptr<Ticket>(new Ticket(*this, address));
}

void ConnectionGuard::release(const std::string& address) {
  std::lock_guard<std::mutex> lk(mu_);
  --open_;
  auto it = per_address_.find(address);
  if (it != per_address_.end() && --it->second <= 0) per_address_.erase(it);
}

int64_t ConnectionGuard::open() const {
  std::lock_guard<std::mutex> lk(mu_);
  return open_;
}

int64_t ConnectionGuard::open_from(const std::string& address) const {
  std::lock_guard<std::mutex> lk(mu_);
  const auto it = per_address_.find(address);
  return it == per_address_.end() ? 0 : it->second;
}

std::string peer_address(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return "?";
  char buf[INET6_ADDRSTRLEN] = {0};
  if (a.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&a)->sin_addr, buf, sizeof(buf));
  } else if (a.ss_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&a)->sin6_addr, buf, sizeof(buf));
  } else {
    return "local";
  }
  return buf;
}

uint64_t raise_descriptor_limit() {
  rlimit l{};
  if (::getrlimit(RLIMIT_NOFILE, &l) != 0) return 0;
  const rlim_t most = l.rlim_max == RLIM_INFINITY ? rlim_t{1} << 20 : l.rlim_max;
  if (l.rlim_cur == RLIM_INFINITY || l.rlim_cur >= most) return l.rlim_cur;
  rlimit raised = l;
  raised.rlim_cur = most;
  if (::setrlimit(RLIMIT_NOFILE, &raised) != 0) return l.rlim_cur;
  return most;
}

int listen_tcp(const std::string& host, int port, int backlog, int* bound_port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return -1;
  int fd = -1;
  for (addrinfo* ai = res; ai && fd < 0; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    int yes = 1;  // quick restarts; no SO_REUSEPORT (a port in use must fail)
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd, backlog) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(res);
  if (fd < 0) return -1;
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  *bound_port = a.ss_family == AF_INET6
                    ? ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port)
                    : ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
  return fd;
}

}  // namespace spes
