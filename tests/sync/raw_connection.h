// Raw TCP connections for tests of what a server does with connections that never speak its
// protocol: connecting from a chosen 127.0.0.x source address (the server's per-address limits
// see distinct addresses), waiting for the server to close a connection, holding many.
#pragma once
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace spes::sync::testing {

// A TCP connection from `source` (a 127.0.0.x address) to 127.0.0.1:port; -1 on failure.
inline int connect_from(const std::string& source, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  ::inet_pton(AF_INET, source.c_str(), &a.sin_addr);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Reads what the server sent on `fd` (appended to *got) until it closes the connection or
// `seconds` pass; true when it closed it.
inline bool closed_by_server(int fd, double seconds, std::string* got = nullptr) {
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  do {  // at least once (seconds = 0: only what is there now)
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, seconds > 0 ? 100 : 0) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return true;
    if (got) got->append(buf, static_cast<size_t>(n));
  } while (std::chrono::steady_clock::now() < until);
  return false;
}

// How many of `fds` the server has closed, waiting until `want` are or `seconds` pass.
inline int count_closed(const std::vector<int>& fds, int want, double seconds) {
  std::vector<bool> closed(fds.size(), false);
  int n = 0;
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  while (n < want && std::chrono::steady_clock::now() < until) {
    for (size_t i = 0; i < fds.size(); ++i)
      if (!closed[i] && closed_by_server(fds[i], 0.0)) closed[i] = true, ++n;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return n;
}

struct RawSockets {
  std::vector<int> fds;
  ~RawSockets() { close_all(); }
  void close_all() {
    for (int fd : fds) ::close(fd);
    fds.clear();
  }
};

}  // namespace spes::sync::testing
