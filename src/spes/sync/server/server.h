// The sync server process: the gRPC service (proto/spes_sync.proto) over RoundState, with TLS
// when spes_config.tls_cert/tls_key are set. Without node tokens (spes_config.auth_tokens_file)
// it binds loopback only. Serves the status page (dashboard/dashboard_server.h, data from
// dashboard_status.h) on spes_config.dashboard_host:dashboard_port unless the port is -1.
// Writes DIR/server.json with the bound address (port 0 picks a free port) and the dashboard's
// URL, ticks RoundState (deadlines, dead nodes, logs), and runs until every node has left,
// stop() is called or the stop flag is raised. Leaves out: the round logic (round_state.h).
#pragma once
#include <atomic>
#include <memory>
#include <string>

#include "spes/io/config.h"
#include "spes/sync/server/round_state.h"

namespace spes::sync {

struct ServerOptions {
  std::string listen = "127.0.0.1:0";  // host:port; port 0: any free port (non-loopback
                                       // needs spes_config.auth_tokens_file)
  bool exit_when_done = true;          // return from run() once every node has left
  ServeOptions state;                  // out_dir, keep_uploads
};

class SyncServer {
 public:
  SyncServer(const Config& cfg, ServerOptions opts);
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

// True for 127.0.0.0/8, ::1 and "localhost".
bool is_loopback_host(const std::string& host_port);

}  // namespace spes::sync
