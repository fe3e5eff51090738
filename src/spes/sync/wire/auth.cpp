// Node tokens and TLS material (see auth.h).
#include "spes/sync/wire/auth.h"

#include <arpa/inet.h>
#include <sys/stat.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>

#include "spes/common/error.h"
#include "spes/io/files.h"

namespace spes::sync {

namespace {
std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ' ||
                        s.back() == '\t'))
    s.pop_back();
  size_t i = 0;
  while (i < s.size() && (s[i] == ' ' || s[i] == '\t')) ++i;
  return s.substr(i);
}
}  // namespace

std::vector<std::string> load_node_tokens(const std::string& path, int64_t num_peers) {
  SPES_CHECK(std::filesystem::exists(path), "spes_config.auth_tokens_file '{}' does not exist "
             "(write a YAML map of node id -> secret token, e.g. `0: <32 random characters>`)",
             path);
  check_private_file(path, "spes_config.auth_tokens_file");
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const std::exception& e) {
    fail("spes_config.auth_tokens_file '{}' is not valid YAML: {}", path, e.what());
  }
  SPES_CHECK(root.IsMap(), "spes_config.auth_tokens_file '{}' must be a YAML map of node id -> "
             "token", path);
  std::vector<std::string> tokens(static_cast<size_t>(num_peers));
  for (const auto& kv : root) {
    int64_t id = -1;
    try {
      id = kv.first.as<int64_t>();
    } catch (const std::exception&) {
      fail("{}: key '{}' is not a node id", path, kv.first.Scalar());
    }
    SPES_CHECK(id >= 0 && id < num_peers, "{}: node id {} is outside [0, {}) (spes_config."
               "num_peers, or max_nodes when nodes may arrive)", path, id, num_peers);
    SPES_CHECK(kv.second.IsScalar(), "{}: the token of node {} must be a string", path, id);
    const std::string t = trim(kv.second.Scalar());
    SPES_CHECK(t.size() >= kMinTokenChars, "{}: the token of node {} is shorter than {} "
               "characters (use e.g. `openssl rand -hex 16`)", path, id, kMinTokenChars);
    SPES_CHECK(tokens[id].empty(), "{}: node {} is listed twice", path, id);
    tokens[id] = t;
  }
  std::set<std::string> distinct;
  for (int64_t i = 0; i < num_peers; ++i) {
    SPES_CHECK(!tokens[i].empty(), "{}: node {} has no token (every node id in [0, {}) needs "
               "one: num_peers, or spes_config.max_nodes with the ids that may arrive)",
               path, i, num_peers);
    SPES_CHECK(distinct.insert(tokens[i]).second, "{}: node {} shares its token with another "
               "node; each node needs its own secret", path, i);
  }
  return tokens;
}

std::string node_token(const std::string& token_file) {
  if (!token_file.empty()) {
    SPES_CHECK(std::filesystem::exists(token_file), "--token-file '{}' does not exist",
               token_file);
    check_private_file(token_file, "--token-file");
    std::string s = file_read(token_file);
    s = trim(s.substr(0, s.find('\n')));
    SPES_CHECK(!s.empty(), "--token-file '{}' is empty", token_file);
    return s;
  }
  const char* env = std::getenv("SPES_NODE_TOKEN");
  return env ? trim(env) : std::string();
}

std::string read_token_file(const std::string& path, const char* flag) {
  if (path.empty()) return "";
  SPES_CHECK(std::filesystem::exists(path), "{} '{}' does not exist (write a secret of at least "
             "{} characters into it, e.g. `openssl rand -hex 16 > {}`)", flag, path,
             kMinTokenChars, path);
  check_private_file(path, flag);
  const std::string text = file_read(path);
  const std::string token = trim(text.substr(0, text.find('\n')));
  SPES_CHECK(token.size() >= kMinTokenChars, "{} '{}' holds a token shorter than {} characters "
             "(use e.g. `openssl rand -hex 16 > {}`)", flag, path, kMinTokenChars, path);
  return token;
}

void check_private_file(const std::string& path, const char* what) {
  struct stat st {};
  SPES_CHECK(::stat(path.c_str(), &st) == 0, "{} '{}': cannot stat it: {}", what, path,
             std::strerror(errno));
  SPES_CHECK((st.st_mode & (S_IRWXG | S_IRWXO)) == 0, "{} '{}' holds secrets but group or "
             "others may access it (mode {:03o}): run `chmod 600 {}`", what, path,
             st.st_mode & 0777, path);
}

bool token_equal(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

std::string read_pem(const std::string& path, const char* key) {
  if (path.empty()) return "";
  SPES_CHECK(std::filesystem::exists(path), "spes_config.{} '{}' does not exist", key, path);
  std::string s = file_read(path);
  SPES_CHECK(s.find("-----BEGIN") != std::string::npos, "spes_config.{} '{}' is not a PEM file",
             key, path);
  return s;
}

std::string address_host(const std::string& address) {
  std::string a = address;
  for (const char* scheme : {"ipv4:", "ipv6:"})
    if (a.rfind(scheme, 0) == 0) a = a.substr(std::strlen(scheme));
  if (a.rfind("dns:", 0) == 0) {
    a = a.substr(4);
    if (a.rfind("//", 0) == 0) {  // dns://authority/host:port
      const size_t slash = a.find('/', 2);
      a = slash == std::string::npos ? "" : a.substr(slash + 1);
    }
  }
  if (!a.empty() && a[0] == '[') {
    const size_t close = a.find(']');
    return close == std::string::npos ? a : a.substr(1, close - 1);
  }
  const size_t colons = static_cast<size_t>(std::count(a.begin(), a.end(), ':'));
  if (colons == 1) return a.substr(0, a.find(':'));
  return a;  // a bare host, or a bare IPv6 address
}

bool is_ip_literal(const std::string& host) {
  std::string h = host;
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  unsigned char buf[sizeof(in6_addr)];
  return ::inet_pton(AF_INET, h.c_str(), buf) == 1 || ::inet_pton(AF_INET6, h.c_str(), buf) == 1;
}

bool is_loopback_host(const std::string& address) {
  if (address.rfind("unix:", 0) == 0 || address.rfind("unix-abstract:", 0) == 0) return true;
  const std::string host = address_host(address);
  if (host == "localhost") return true;
  in_addr v4{};
  if (::inet_pton(AF_INET, host.c_str(), &v4) == 1)
    return (ntohl(v4.s_addr) >> 24) == 127;  // 127.0.0.0/8
  in6_addr v6{};
  if (::inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;  // ::ffff:127.x.y.z
  }
  return false;
}

}  // namespace spes::sync
