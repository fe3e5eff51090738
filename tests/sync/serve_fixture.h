// A real `spes serve` process on loopback for the tests that talk to it with raw gRPC stubs
// (hostile clients) or real clients: node tokens in a private file (node i's token is
// ServeFixture::token(i)), a tiny MoE model (by default with a vocabulary of 8192, so that a
// download is bigger than the transport's flow-control window), merging and the dashboard off;
// call metadata and deadlines for raw calls. Also: writing a secret file with given permissions.
#pragma once
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "spes/io/config.h"
#include "spes/sync/wire/auth.h"
#include "spes/sync/wire/protocol.h"
#include "spes_sync.grpc.pb.h"
#include "sync/sync_process_util.h"
#include "sync/sync_test_util.h"

namespace spes::sync::testing {

inline void write_secret(const std::string& path, const std::string& text,
                         std::filesystem::perms mode) {
  {
    std::ofstream f(path);
    f << text;
  }
  std::filesystem::permissions(path, mode);
}
inline const std::filesystem::perms kPrivate =
    std::filesystem::perms::owner_read | std::filesystem::perms::owner_write;

struct ServeSetup {
  std::vector<std::string> args;  // more arguments of `spes serve`
  std::string listen = "127.0.0.1:0";
  std::string extra_config;       // more lines of spes_config (indented by two spaces)
  int num_peers = 2;
  int vocab_size = 8192;
  int num_experts = 4;            // a multiple of num_peers
  std::vector<std::string> wrapper;  // a command the server runs under (e.g. prlimit ...)
};

struct ServeFixture {
  TempDir tmp;
  std::string cfg_path;
  Config cfg;
  std::unique_ptr<Proc> srv;
  std::string address;

  static std::string token(int node) {
    return "token-of-node-" + std::to_string(node) + "-0123456789abcdef";
  }
  explicit ServeFixture(const ServeSetup& setup = {}) {
    std::string tokens;
    for (int i = 0; i < setup.num_peers; ++i) tokens += std::to_string(i) + ": " + token(i) + "\n";
    write_secret(tmp.path + "/tokens.yaml", tokens, kPrivate);
    cfg_path = tmp.path + "/config.yaml";
    std::ofstream(cfg_path)
        << "model:\n  d_model: 32\n  n_layers: 1\n  n_heads: 2\n  mlp_hidden_size: 32\n"
           "  moe_num_experts: " << setup.num_experts << "\n  moe_top_k: 2\n  vocab_size: "
        << setup.vocab_size << "\n"
           "  max_sequence_length: 8\n"
           "spes_config:\n  mode: spes\n  num_peers: " << setup.num_peers << "\n"
           "  sync_steps: 10\n  merge_interval: 0\n  dashboard_port: -1\n  auth_tokens_file: "
        << tmp.path << "/tokens.yaml\n" << setup.extra_config;
    cfg = config_load(cfg_path, {});
    srv = start_server(cfg_path, tmp.path + "/srv", setup.listen, setup.args, setup.wrapper);
    address = server_address(*srv, tmp.path + "/srv");
  }
  ~ServeFixture() {
    if (srv && !srv->exited) srv->kill9();
  }
  std::unique_ptr<v1::SpesSync::Stub> stub(bool own_connection = false) const {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxMessageBytes);
    if (own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    // No window growth: a download the client does not read stays stuck in the server.
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    return v1::SpesSync::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  }
  // The number of threads of the server process.
  size_t threads() const {
    size_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator(
             "/proc/" + std::to_string(srv->p->pid()) + "/task")) {
      (void)e;
      ++n;
    }
    return n;
  }
};

inline void set_deadline(grpc::ClientContext& ctx, double s) {
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(s * 1000)));
}
// Node `node`'s credentials as call metadata (no token metadata when `token` is empty).
inline void credentials(grpc::ClientContext& ctx, int64_t node, const std::string& token) {
  ctx.AddMetadata(kNodeIdMetadata, std::to_string(node));
  if (!token.empty()) ctx.AddMetadata(kNodeTokenMetadata, token);
}

// Calls f() again while the server refuses it as UNAVAILABLE (its call rate limit after a
// flood, a connection closed by the guard), as a node's retries do; at most `seconds`.
template <class F>
auto retried(F&& f, double seconds = 10) {
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  for (;;) {
    try {
      return f();
    } catch (const SyncError& e) {
      if (e.code() != SyncErrc::Unavailable || std::chrono::steady_clock::now() > until) throw;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

}  // namespace spes::sync::testing
