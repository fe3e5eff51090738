// Who may talk to the sync server: per-node secret tokens and TLS material. The server reads
// spes_config.auth_tokens_file (a YAML map: node id -> token); a node takes its token from
// --token-file or the environment variable SPES_NODE_TOKEN. Tokens are compared in constant
// time and never logged. Leaves out: what a node may upload (plan.h) and transport (server.h,
// client.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace spes::sync {

constexpr size_t kMinTokenChars = 16;

// Tokens of nodes 0..num_peers-1 from a YAML map file ("0: secret0\n1: secret1\n"). Every node
// must have a token of at least kMinTokenChars characters; tokens must differ.
std::vector<std::string> load_node_tokens(const std::string& path, int64_t num_peers);
// A node's token: the first line of `token_file` when given, else $SPES_NODE_TOKEN, else "".
std::string node_token(const std::string& token_file);
// Constant-time comparison (no early exit on the first differing byte).
bool token_equal(const std::string& a, const std::string& b);
// Contents of a PEM file named in the config (empty path: empty string).
std::string read_pem(const std::string& path, const char* key);

}  // namespace spes::sync
