// Who may talk to the sync server: per-node secret tokens, the read token of `spes status` and
// the dashboard, TLS material, and whether an address is loopback. The server reads
// spes_config.auth_tokens_file (a YAML map: node id -> token); a node takes its token from
// --token-file or the environment variable SPES_NODE_TOKEN. Token files must not be readable by
// group or others (like ssh keys). Tokens are compared in constant time and never logged.
// Leaves out: what a node may upload (plan.h) and transport (server.h, client.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace spes::sync {

constexpr size_t kMinTokenChars = 16;

// gRPC call metadata that carries credentials (never a message body): every node call has the
// node id and, with tokens, its token; Status has the read token when the server needs one.
constexpr const char* kNodeIdMetadata = "x-spes-node-id";
constexpr const char* kNodeTokenMetadata = "x-spes-node-token";
constexpr const char* kReadTokenMetadata = "x-spes-read-token";

// Tokens of nodes 0..num_peers-1 (pass SpesConfig::node_slots(): arrivals included) from a YAML map file ("0: secret0\n1: secret1\n"). Every node
// must have a token of at least kMinTokenChars characters; tokens must differ.
std::vector<std::string> load_node_tokens(const std::string& path, int64_t num_peers);
// A node's token: the first line of `token_file` when given, else $SPES_NODE_TOKEN, else "".
std::string node_token(const std::string& token_file);
// The read token of `spes serve --read-token-file` / `spes status --read-token-file`: the first
// line of the file (at least kMinTokenChars characters); "" for an empty path.
std::string read_token_file(const std::string& path, const char* flag);
// Refuses a secret file that group or others may read or write (names `chmod 600 FILE`).
void check_private_file(const std::string& path, const char* what);
// Constant-time comparison (no early exit on the first differing byte).
bool token_equal(const std::string& a, const std::string& b);
// Contents of a PEM file named in the config (empty path: empty string).
std::string read_pem(const std::string& path, const char* key);

// True when the host of `address` is a loopback address: 127.0.0.0/8, ::1 (also
// "[::1]:port" and IPv4-mapped ::ffff:127.x.y.z) or exactly "localhost"; also unix: sockets.
// The host is parsed as an address, never prefix-matched: "127.evil.com" is not loopback.
// Accepts "host", "host:port", "[v6]:port", a bare v6 address and gRPC's "ipv4:", "ipv6:",
// "dns:[//authority/]" prefixes.
bool is_loopback_host(const std::string& address);
// The host part of `address` (forms as above), without brackets or port.
std::string address_host(const std::string& address);
// True when `host` (no port) is an IPv4 or IPv6 address literal (brackets allowed).
bool is_ip_literal(const std::string& host);

}  // namespace spes::sync
