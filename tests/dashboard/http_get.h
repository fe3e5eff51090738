// A raw HTTP/1.0 GET over a loopback socket (independent of the server's own code), and the
// status code and body of its response: for the tests of the status page.
#pragma once
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace spes::dashboard::testing {

// `host`: the Host header ("" sends none); `authorization`: an Authorization header if set.
inline std::string http_get(int port, const std::string& path, const std::string& host = "127.0.0.1",
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

inline int status_of(const std::string& response) {
  return response.rfind("HTTP/1.", 0) == 0 && response.size() > 12 ? std::atoi(&response[9]) : 0;
}

inline std::string body_of(const std::string& response) {
  const size_t p = response.find("\r\n\r\n");
  return p == std::string::npos ? "" : response.substr(p + 4);
}

}  // namespace spes::dashboard::testing
