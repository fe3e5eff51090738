// `spes serve`: the SPES sync server. Collects each round's uploads, aggregates and merges
// them, persists the published model in DIR and appends one line per round to
// DIR/rounds.jsonl; serves the live status page (spes_config.dashboard_port, docs/DASHBOARD.md);
// exits once every node has left (or on SIGINT/SIGTERM). Restarted with the same DIR it
// continues from the last published round (--overwrite starts over).
#include <malloc.h>
#include <signal.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <filesystem>

#include "cli/common_options.h"
#include "cli/command.h"
#include "cli/tls_dir.h"
#include "spes/interop/init_checkpoint.h"
#include "spes/io/config.h"
#include "spes/io/run_lock.h"
#include "spes/io/run_layout.h"
#include "spes/model/model_size_guard.h"
#include "spes/sync/server/server.h"
#include "spes/train/device.h"

namespace {
namespace fs = std::filesystem;

std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop = true; }

struct ServeArgs {
  std::string config, out = "runs/server", listen;
  std::vector<std::string> sets;
  bool keep_uploads = false, overwrite = false, keep_running = false;
  bool insecure = false, bind_client_certs = false;
  std::string read_token_file;
  double first_message_timeout = 10;
  std::string tls_dir;
  spes::GuardSettings guard = spes::sync::default_guard();
};

void run_serve(const ServeArgs& a) {
#ifdef __GLIBC__
  // Chunks and tensor pieces of 1-4 MiB come and go on many gRPC threads; with glibc's
  // adaptive mmap threshold they end up in per-thread arenas that never shrink (measured: peak
  // RSS 1007 MiB instead of 640 MiB for a 252 MB model). A fixed threshold returns them. (This
  // lowers the 32 MiB of keep_freed_heap_memory, set in main: the server's peak memory has a
  // target, and 32 MiB here gave no faster rounds, docs/PERFORMANCE.md. Its heap keeps the
  // smaller blocks, as every spes process does.)
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  // The smaller pieces (gRPC's slices, per-run checks) of several streams at once, each thread
  // in its own arena, stayed resident after use: ~140 MiB after one round with the d_model 512
  // shape (docs/PERFORMANCE.md, sync benchmark). One arena reuses them across threads.
  mallopt(M_ARENA_MAX, 1);
#endif
  spes::Config cfg = spes::config_load(a.config, a.sets);
  if (!a.tls_dir.empty()) spes::cli::server_tls_from_dir(cfg.spes_config.transport, a.tls_dir);
  spes::configure_threads(cfg);
  namespace layout = spes::run_layout;
  // The server holds the model in this machine's memory: one larger than it is refused before
  // the run directory (and its lock) exists.
  spes::check_model_fits_memory(cfg.model, "model");
  const spes::RunDirLock lock(a.out);  // one writer per directory; --overwrite refuses a live one
  if (a.overwrite && fs::exists(layout::server_state(a.out))) {
    spdlog::info("--overwrite: starting over in '{}'", a.out);
    for (const std::string& f :
         {layout::server_state(a.out), layout::published(a.out), layout::rounds_log(a.out)})
      fs::remove(f);
    fs::remove_all(layout::kept_rounds(a.out));
    for (const auto& e : fs::directory_iterator(a.out))  // diloco momentum-<round>.safetensors
      if (e.path().filename().string().rfind("momentum-", 0) == 0) fs::remove(e.path());
  }
  spes::sync::ServerOptions o;
  const std::string& addr = cfg.spes_config.transport.server_addr;
  o.listen = a.listen.empty() ? "127.0.0.1:" + addr.substr(addr.rfind(':') + 1) : a.listen;
  o.state.resume = !a.overwrite;
  o.exit_when_done = !a.keep_running;
  o.state.out_dir = a.out;
  o.state.keep_uploads = a.keep_uploads;
  o.insecure = a.insecure;
  o.read_token_file = a.read_token_file;
  o.bind_client_certs = a.bind_client_certs || !a.tls_dir.empty();
  o.first_message_timeout_s = a.first_message_timeout;
  o.guard = a.guard;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  spes::sync::SyncServer server(cfg, o, spes::init_checkpoint_weights(cfg.model));
  server.run(&g_stop);
  if (g_stop) spdlog::info("sync server stopped by signal");
}

spes::cli::SubcommandRegistrar register_serve("serve", "Run the SPES sync server", [](CLI::App& sub) {
  auto a = std::make_shared<ServeArgs>();
  sub.add_option("--config", a->config, "YAML config (the nodes must use the same one)");
  sub.add_option("--out", a->out, "Server directory (published model, state.json, rounds.jsonl)");
  sub.add_option("--listen", a->listen,
                 "host:port to bind (default: 127.0.0.1 and the port of spes_config.server_addr; "
                 "port 0 picks a free one, written to OUT/server.json; a non-loopback address "
                 "needs spes_config.auth_tokens_file, and TLS or --insecure)");
  sub.add_flag("--insecure", a->insecure, "Allow listening off loopback without TLS (tokens and "
               "models cross the network in cleartext; warned on every start)");
  sub.add_option("--read-token-file", a->read_token_file, "File with the read token that "
                 "`spes status` and the dashboard must present (required for them off "
                 "loopback; chmod 600)");
  sub.add_option("--tls-dir", a->tls_dir, "Mutual TLS with the files `spes certs` made: "
                 "DIR/server.pem and server.key, client certificates of DIR/ca.pem required and "
                 "bound to node ids (as --bind-client-certs); the default way to listen off "
                 "loopback");
  sub.add_flag("--bind-client-certs", a->bind_client_certs, "Node i's TLS client certificate "
               "must name node<i> (common name or subject alternative name; needs "
               "spes_config.tls_client_ca)");
  sub.add_option("--first-message-timeout", a->first_message_timeout, "Seconds an upload "
                 "stream may take to send its first message before the server ends it")
      ->check(CLI::Range(0.1, 3600.0));
  sub.add_option("--max-connections", a->guard.max_connections, "Connections the sync port "
                 "holds open at once (the connection guard; lowered to what the process's "
                 "descriptors allow)")->check(CLI::Range(int64_t{4}, int64_t{1} << 20));
  sub.add_option("--max-connections-per-address", a->guard.per_address, "Connections one "
                 "source address may hold open (addresses that proved node credentials are "
                 "exempt)")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  sub.add_option("--handshake-timeout", a->guard.first_bytes_timeout_s, "Seconds a new "
                 "connection has to send its HTTP/2 preface before it is closed")
      ->check(CLI::Range(0.1, 3600.0));
  sub.add_option("--idle-connection-timeout", a->guard.idle_timeout_s, "Seconds without a "
                 "byte either way after which a connection is closed (longer than a "
                 "long-poll, 30 s)")->check(CLI::Range(0.5, 86400.0));
  spes::cli::add_set_option(sub, a->sets);
  sub.add_flag("--keep-uploads", a->keep_uploads,
               "Keep OUT/rounds/<round>/node<i>.safetensors and published.safetensors");
  sub.add_flag("--overwrite", a->overwrite,
               "Start over even if OUT holds a previous run (default: continue from it)");
  sub.add_flag("--keep-running", a->keep_running, "Do not exit when every node has left");
  sub.callback([a] { run_serve(*a); });
}, spes::cli::GpuUse::Never);

}  // namespace
