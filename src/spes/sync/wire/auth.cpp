// Node tokens and TLS material (see auth.h).
#include "spes/sync/wire/auth.h"

#include <yaml-cpp/yaml.h>

#include <cstdlib>
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
    SPES_CHECK(id >= 0 && id < num_peers, "{}: node id {} is outside [0, num_peers={})", path,
               id, num_peers);
    SPES_CHECK(kv.second.IsScalar(), "{}: the token of node {} must be a string", path, id);
    const std::string t = trim(kv.second.Scalar());
    SPES_CHECK(t.size() >= kMinTokenChars, "{}: the token of node {} is shorter than {} "
               "characters (use e.g. `openssl rand -hex 16`)", path, id, kMinTokenChars);
    SPES_CHECK(tokens[id].empty(), "{}: node {} is listed twice", path, id);
    tokens[id] = t;
  }
  std::set<std::string> distinct;
  for (int64_t i = 0; i < num_peers; ++i) {
    SPES_CHECK(!tokens[i].empty(), "{}: node {} has no token (every node in [0, {}) needs one)",
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
    std::string s = file_read(token_file);
    s = trim(s.substr(0, s.find('\n')));
    SPES_CHECK(!s.empty(), "--token-file '{}' is empty", token_file);
    return s;
  }
  const char* env = std::getenv("SPES_NODE_TOKEN");
  return env ? trim(env) : std::string();
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

}  // namespace spes::sync
