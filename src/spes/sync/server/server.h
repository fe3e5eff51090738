// The sync server process: the gRPC service (proto/spes_sync.proto) over RoundState, with TLS
// when spes_config.tls_cert/tls_key are set. Without node tokens (spes_config.auth_tokens_file)
// it binds loopback only; off loopback it needs TLS unless told --insecure (then it warns).
// Credentials come from call metadata before anything is read (call_auth.h); one upload and one
// download stream per node, idle streams ended (stream_limits.h), threads and streams capped.
// In plaintext a connection guard owns the port (common/guarded_listener.h): connections are
// capped in total and per address, half-open and idle ones closed, before gRPC sees a byte.
// Serves the status page (dashboard/dashboard_server.h, data from dashboard_status.h; Host
// checked, read token off loopback) on spes_config.dashboard_host:dashboard_port unless -1.
// Writes DIR/server.json with the bound address (port 0 picks a free port) and the dashboard's
// URL, ticks RoundState (deadlines, dead nodes, logs), and runs until every node has left,
// stop() is called or the stop flag is raised. Leaves out: the round logic (round_state.h).
#pragma once
#include <atomic>
#include <memory>
#include <optional>
#include <string>

#include "spes/common/guarded_listener.h"
#include "spes/io/config.h"
#include "spes/sync/server/round_state.h"

namespace spes::sync {

// The connection guard's defaults for the sync port (reserved_for_known -1: 8 per node).
inline GuardSettings default_guard() {
  GuardSettings g;
  g.reserved_for_known = -1;
  return g;
}

struct ServerOptions {
  std::string listen = "127.0.0.1:0";  // host:port; port 0: any free port (non-loopback
                                       // needs spes_config.auth_tokens_file)
  bool exit_when_done = true;          // return from run() once every node has left
  bool insecure = false;               // allow plaintext off loopback (warns on every start)
  std::string read_token_file;         // Status and the dashboard need this token ("": only
                                       // on loopback, without a token)
  bool bind_client_certs = false;      // node i's TLS client certificate must name "node<i>"
  double first_message_timeout_s = 10; // a stream's first message must come within this
  double stream_idle_timeout_s = 120;  // later messages of a stream within this
  int max_threads = 0;                 // gRPC thread cap (0: 64 + 8 per node)
  GuardSettings guard = default_guard();  // the connection guard in front of gRPC
  ServeOptions state;                  // out_dir, keep_uploads
};

class SyncServer {
 public:
  // `initial`: the initial model's weights when the run names model.init_checkpoint.
  SyncServer(const Config& cfg, ServerOptions opts,
             std::optional<InitialWeights> initial = std::nullopt);
  ~SyncServer();
  int port() const;
  std::string address() const;  // "host:port" actually bound
  std::string dashboard_url() const;  // "http://host:port/" ("" when the dashboard is off)
  // Serves until every node has left (exit_when_done), stop() or *stop_flag becomes true.
  void run(const std::atomic<bool>* stop_flag = nullptr);
  void stop();
  RoundState& state();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spes::sync
