// Credentials of a call, from its metadata and TLS peer (see call_auth.h).
#include "spes/sync/server/call_auth.h"

#include <grpc/grpc_security_constants.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/auth_context.h>

#include <algorithm>
#include <charconv>
#include <iterator>

#include "spes/sync/wire/auth.h"

namespace spes::sync {

namespace {

// The single value of metadata `key` ("" when absent; a repeated key is refused).
std::string metadata(const grpc::ServerContext& ctx, const char* key) {
  const auto& md = ctx.client_metadata();
  const auto range = md.equal_range(key);
  if (range.first == range.second) return "";
  if (std::next(range.first) != range.second)
    sync_fail(SyncErrc::PermissionDenied, "call metadata '{}' is given more than once", key);
  return std::string(range.first->second.data(), range.first->second.size());
}

}  // namespace

CallAuth::CallAuth(const Config& cfg, CallAuthOptions opts)
    : num_peers_(cfg.spes_config.node_slots()), opts_(std::move(opts)) {
  if (!cfg.spes_config.transport.auth_tokens_file.empty())
    tokens_ = load_node_tokens(cfg.spes_config.transport.auth_tokens_file, num_peers_);
}

NodeId CallAuth::node(const grpc::ServerContext& ctx, uint64_t incarnation) const {
  std::vector<std::string> cert_names;
  if (opts_.bind_client_certs)
    if (const auto auth = ctx.auth_context())
      for (const char* prop : {GRPC_X509_CN_PROPERTY_NAME, GRPC_X509_SAN_PROPERTY_NAME})
        for (const auto& v : auth->FindPropertyValues(prop))
          cert_names.emplace_back(v.data(), v.size());
  return check(metadata(ctx, kNodeIdMetadata), metadata(ctx, kNodeTokenMetadata), cert_names,
               incarnation);
}

NodeId CallAuth::check(const std::string& id_text, const std::string& token,
                       const std::vector<std::string>& cert_names, uint64_t incarnation) const {
  int64_t id = -1;
  const auto [end, ec] = std::from_chars(id_text.data(), id_text.data() + id_text.size(), id);
  if (id_text.empty() || ec != std::errc() || end != id_text.data() + id_text.size())
    sync_fail(SyncErrc::PermissionDenied, "the call has no valid '{}' metadata (a node of this "
              "protocol version sends its id and token as call metadata)", kNodeIdMetadata);
  if (id < 0 || id >= num_peers_)
    sync_fail(SyncErrc::PermissionDenied, "node id {} is outside [0, max_nodes={}) (spes_config."
              "max_nodes, or num_peers when no node may arrive)", id, num_peers_);
  if (!tokens_.empty() && !token_equal(token, tokens_[id]))
    sync_fail(SyncErrc::PermissionDenied, "node {}: wrong or missing token (set the node's "
              "token from spes_config.auth_tokens_file with --token-file or SPES_NODE_TOKEN)", id);
  if (opts_.bind_client_certs) {
    const std::string want = "node" + std::to_string(id);
    if (std::find(cert_names.begin(), cert_names.end(), want) == cert_names.end())
      sync_fail(SyncErrc::PermissionDenied, "node {}: its TLS client certificate does not name "
                "'{}' (--bind-client-certs: give node {} a certificate whose common name or "
                "subject alternative name is {})", id, want, id, want);
  }
  return NodeId{id, incarnation, token};
}

bool CallAuth::read_allowed(const std::string& token) const {
  if (!opts_.read_token.empty()) return token_equal(token, opts_.read_token);
  return opts_.loopback_only;
}

bool CallAuth::holds_read_token(const grpc::ServerContext& ctx) const {
  return !opts_.read_token.empty() &&
         token_equal(metadata(ctx, kReadTokenMetadata), opts_.read_token);
}

void CallAuth::check_read(const grpc::ServerContext& ctx) const {
  if (read_allowed(metadata(ctx, kReadTokenMetadata))) return;
  if (opts_.read_token.empty())
    sync_fail(SyncErrc::PermissionDenied, "this server listens off loopback and has no read "
              "token, so its status is not served (start `spes serve` with --read-token-file "
              "FILE and pass the same file to `spes status --read-token-file`)");
  sync_fail(SyncErrc::PermissionDenied, "wrong or missing read token (pass the server's "
            "--read-token-file to `spes status --read-token-file`)");
}

}  // namespace spes::sync
