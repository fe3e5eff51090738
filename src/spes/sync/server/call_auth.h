// Who is calling the sync server, decided from the call alone before any message body is read:
// the node id and token travel as gRPC metadata (x-spes-node-id, x-spes-node-token; see
// wire/auth.h); with --bind-client-certs the TLS client certificate must name the node
// ("node<i>" as its common name or a subject alternative name). Read access (Status) takes the
// read token (x-spes-read-token) when one is configured, and is refused off loopback without
// one. This is the only place that checks a node's token: RoundState (membership.h) trusts the
// NodeId it is handed. Leaves out: whether the node joined (membership.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "spes/io/config.h"
#include "spes/sync/wire/protocol.h"

namespace grpc {
class ServerContext;
}

namespace spes::sync {

struct CallAuthOptions {
  bool loopback_only = true;      // the server listens on loopback only
  std::string read_token;         // "" : Status needs none (loopback only)
  bool bind_client_certs = false;  // the client certificate must name the node
};

class CallAuth {
 public:
  CallAuth(const Config& cfg, CallAuthOptions opts);
  // The calling node from the call's metadata (and certificate); `incarnation` comes from the
  // message. Throws SyncError PermissionDenied for a missing or malformed id, an id outside
  // the run, a wrong or missing token, or a certificate of another node.
  NodeId node(const grpc::ServerContext& ctx, uint64_t incarnation = 0) const;
  // The same decision from what node() takes out of the call: the node id metadata as text,
  // the token metadata, and the names (common and subject alternative) of the TLS client
  // certificate.
  NodeId check(const std::string& id_text, const std::string& token,
               const std::vector<std::string>& cert_names, uint64_t incarnation = 0) const;
  bool requires_tokens() const { return !tokens_.empty(); }
  // Throws PermissionDenied unless the call may read the server's status.
  void check_read(const grpc::ServerContext& ctx) const;
  // Whether the call carries the server's read token (false when the server has none).
  bool holds_read_token(const grpc::ServerContext& ctx) const;
  // The same decision for a read token already taken from a request (the dashboard).
  bool read_allowed(const std::string& token) const;
  bool read_needs_token() const { return !opts_.loopback_only || !opts_.read_token.empty(); }

 private:
  int64_t num_peers_;  // node ids admitted: SpesConfig::node_slots()
  std::vector<std::string> tokens_;  // per node; empty: no node tokens (loopback only)
  CallAuthOptions opts_;
};

}  // namespace spes::sync
