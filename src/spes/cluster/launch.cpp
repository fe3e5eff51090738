// Local cluster launcher (see launch.h).
#include "spes/cluster/launch.h"

#include <poll.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "spes/cluster/run_report.h"
#include "spes/cluster/subprocess.h"
#include "spes/common/error.h"
#include "spes/common/sysinfo.h"
#include "spes/io/config.h"
#include "spes/io/files.h"
#include "spes/io/run_layout.h"
#include "spes/sync/wire/auth.h"

namespace spes {
namespace fs = std::filesystem;

namespace {
std::atomic<bool> g_interrupted{false};
void on_signal(int) { g_interrupted = true; }

struct Part {
  std::string name;  // "server", "node 3"
  std::unique_ptr<Subprocess> proc;
  std::ofstream log;
  std::vector<std::string> tail;  // last lines, shown when the part fails
  bool done = false;
  int code = 0;
};

void pump(Part& p) {
  std::vector<std::string> lines;
  p.proc->read_lines(&lines);
  for (const auto& l : lines) {
    std::fprintf(stdout, "[%s] %s\n", p.name.c_str(), l.c_str());
    p.log << l << "\n";
    p.tail.push_back(l);
    if (p.tail.size() > 20) p.tail.erase(p.tail.begin());
  }
  if (!lines.empty()) {
    std::fflush(stdout);
    p.log.flush();
  }
}

void stop_all(std::vector<Part>& parts) {
  for (auto& p : parts)
    if (p.proc && p.proc->running()) p.proc->kill(SIGTERM);
  const auto t0 = std::chrono::steady_clock::now();
  for (auto& p : parts) {
    while (p.proc && !p.proc->poll_exit(nullptr) &&
           std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5)) {
      pump(p);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (p.proc && p.proc->running()) p.proc->kill(SIGKILL);
    if (p.proc) p.proc->wait();
    pump(p);
  }
}
}  // namespace

int launch_cluster(const LaunchOptions& o) {
  const Config base = config_load(o.config, o.sets);
  const int64_t N = o.nodes > 0 ? o.nodes
                                : (base.spes_config.num_peers > 1 ? base.spes_config.num_peers : 4);
  std::vector<std::string> sets = o.sets;
  sets.push_back("spes_config.num_peers=" + std::to_string(N));
  if (base.spes_config.mode == SyncMode::Centralized) sets.push_back("spes_config.mode=spes");
  if (base.threads == 0)  // share the cores instead of oversubscribing them N times
    sets.push_back("threads=" + std::to_string(std::max(1, cpu_cores() / static_cast<int>(N))));
  const Config cfg = config_load(o.config, sets);

  // Output directory: refuse to mix with an earlier run unless asked to replace it.
  fs::create_directories(o.out);
  const bool earlier = fs::exists(run_layout::cluster_server(o.out)) ||
                       fs::exists(run_layout::cluster_node(o.out, 0));
  SPES_CHECK(!earlier || o.overwrite, "'{}' holds an earlier run (server/, node0/); choose "
             "another --out or pass --overwrite", o.out);
  fs::remove_all(run_layout::cluster_server(o.out));
  for (const auto& e : fs::directory_iterator(o.out)) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && n.rfind("node", 0) == 0 && n.size() > 4 &&
        n.find_first_not_of("0123456789", 4) == std::string::npos)
      fs::remove_all(e.path());
  }
  const std::string cfg_path = run_layout::cluster_config(o.out);
  file_write_atomic(cfg_path, config_to_yaml(cfg));
  const std::string exe = o.executable.empty() ? executable_path() : o.executable;

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  std::vector<Part> parts(N + 1);
  auto start = [&](Part& p, const std::string& name, const std::string& dir,
                   std::vector<std::string> argv,
                   std::vector<std::pair<std::string, std::string>> env = {}) {
    fs::create_directories(dir);
    p.name = name;
    p.log.open(dir + "/log.txt");
    p.proc = std::make_unique<Subprocess>(argv, env);
  };
  // With node tokens configured, each node gets its own through the environment.
  const std::vector<std::string> tokens =
      cfg.spes_config.transport.auth_tokens_file.empty()
          ? std::vector<std::string>()
          : sync::load_node_tokens(cfg.spes_config.transport.auth_tokens_file, N);
  std::vector<std::string> serve = {exe, "serve", "--config", cfg_path, "--out",
                                    run_layout::cluster_server(o.out), "--listen",
                                    "127.0.0.1:0", "--overwrite"};
  if (o.keep_uploads) serve.push_back("--keep-uploads");
  start(parts[0], "server", run_layout::cluster_server(o.out), serve);
  fmt::print("launch: {} nodes, mode {}, {} steps, sync every {} steps, out {}\n", N,
             cfg.spes_config.mode, cfg.total_steps(), cfg.spes_config.sync_steps, o.out);
  std::fflush(stdout);

  // Wait for the server to say where it listens (and where its status page is).
  std::string address, dashboard;
  const auto t0 = std::chrono::steady_clock::now();
  while (address.empty()) {
    pump(parts[0]);
    if (parts[0].proc->poll_exit(&parts[0].code) || g_interrupted ||
        std::chrono::steady_clock::now() - t0 > std::chrono::seconds(120)) {
      stop_all(parts);
      fmt::print(stderr, "launch: the sync server did not start (exit code {})\n",
                 parts[0].code);
      return 1;
    }
    const std::string sj = run_layout::server_info(run_layout::cluster_server(o.out));
    if (fs::exists(sj)) {
      try {
        const nlohmann::json info = nlohmann::json::parse(file_read(sj));
        address = info.at("address").get<std::string>();
        dashboard = info.value("dashboard", "");
      } catch (const std::exception&) {
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (!dashboard.empty()) fmt::print("dashboard: {}\n", dashboard);
  std::fflush(stdout);
  for (int64_t i = 0; i < N; ++i) {
    std::vector<std::string> argv = {exe, "node", "--config", cfg_path, "--node-id",
                                     std::to_string(i), "--server", address, "--out",
                                     run_layout::cluster_node(o.out, i), "--progress", "lines",
                                     "--resume", "none"};
    if (o.nproc_per_node > 1)
      argv.insert(argv.end(), {"--nproc-per-node", std::to_string(o.nproc_per_node)});
    start(parts[i + 1], fmt::format("node {}", i), run_layout::cluster_node(o.out, i), argv,
          tokens.empty() ? std::vector<std::pair<std::string, std::string>>()
                         : std::vector<std::pair<std::string, std::string>>{
                               {"SPES_NODE_TOKEN", tokens[i]}});
  }

  // Combined view; the first failure stops everything.
  std::string failure;
  std::chrono::steady_clock::time_point server_exit;
  for (;;) {
    std::vector<pollfd> fds;
    for (auto& p : parts)
      if (p.proc->output_fd() >= 0) fds.push_back({p.proc->output_fd(), POLLIN, 0});
    ::poll(fds.data(), fds.size(), 200);
    bool nodes_done = true;
    for (size_t k = 0; k < parts.size(); ++k) {
      Part& p = parts[k];
      pump(p);
      if (!p.done && p.proc->poll_exit(&p.code)) {
        pump(p);
        p.done = true;
        if (p.code != 0 && failure.empty())
          failure = fmt::format("{} exited with code {}", p.name, p.code);
        if (k == 0) server_exit = std::chrono::steady_clock::now();
      }
      if (k > 0 && !p.done) nodes_done = false;
    }
    // The server exits once every node has left; the nodes exit right after. A server gone
    // for long while nodes still run means they lost it.
    if (parts[0].done && !nodes_done && failure.empty() &&
        std::chrono::steady_clock::now() - server_exit > std::chrono::seconds(30))
      failure = "the sync server exited while nodes were still running";
    if (g_interrupted && failure.empty()) failure = "interrupted";
    if (!failure.empty() || nodes_done) break;
  }
  if (failure.empty()) {
    // Every node left: the server exits by itself.
    const auto t1 = std::chrono::steady_clock::now();
    while (!parts[0].done && std::chrono::steady_clock::now() - t1 < std::chrono::seconds(60)) {
      pump(parts[0]);
      if (parts[0].proc->poll_exit(&parts[0].code)) parts[0].done = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (!parts[0].done) failure = "the sync server did not exit after every node left";
    else if (parts[0].code != 0) failure = fmt::format("server exited with code {}", parts[0].code);
  }
  if (!failure.empty()) {
    stop_all(parts);
    fmt::print(stderr, "launch: FAILED: {}\n", failure);
    for (const auto& p : parts)
      if (p.done && p.code != 0) {
        fmt::print(stderr, "--- last lines of {} ---\n", p.name);
        for (const auto& l : p.tail) fmt::print(stderr, "{}\n", l);
      }
    return g_interrupted ? 130 : 1;
  }
  for (auto& p : parts) pump(p);

  nlohmann::json rep = cluster_report(o.out, N);
  if (o.keep_uploads) rep["verify"] = verify_kept_rounds(cfg, run_layout::cluster_server(o.out));
  file_write_atomic(run_layout::cluster_summary(o.out), rep.dump(2) + "\n");
  fmt::print("\n=== summary ({}) ===\n{}", o.out, format_cluster_report(rep));
  std::fflush(stdout);
  bool ok = rep["all_nodes_same_model_after_every_sync"].get<bool>();
  if (rep.contains("verify"))
    ok = ok && rep["verify"]["equal"] == rep["verify"]["checked"];
  if (!ok) fmt::print(stderr, "launch: FAILED: a consistency check did not pass (see above)\n");
  return ok ? 0 : 1;
}

}  // namespace spes
