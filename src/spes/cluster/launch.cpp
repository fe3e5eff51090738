// Local cluster launcher (see launch.h).
#include "spes/cluster/launch.h"

#include <poll.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "spes/cluster/launch_disruption.h"
#include "spes/cluster/launch_view.h"
#include "spes/cluster/run_report.h"
#include "spes/cluster/subprocess.h"
#include "spes/common/error.h"
#include "spes/common/stop_signal.h"
#include "spes/common/sysinfo.h"
#include "spes/io/config.h"
#include "spes/io/files.h"
#include "spes/io/run_layout.h"
#include "spes/io/run_lock.h"
#include "spes/sync/wire/auth.h"

namespace spes {
namespace fs = std::filesystem;

namespace {
using Clock = std::chrono::steady_clock;
using Env = std::vector<std::pair<std::string, std::string>>;

struct Part {
  std::string name;  // "server", "node 3"
  size_t index = 0;  // in the view: 0 the server, i + 1 node i
  std::unique_ptr<Subprocess> proc;
  std::ofstream log;
  std::vector<std::string> tail;  // last lines, shown when the part fails
  bool done = false;
  int code = 0;
  bool stopped_on_purpose = false;  // a scripted disruption: its exit is no failure
};

// Where the server listens, and its status page (empty without a dashboard).
struct ServerAddress {
  std::string address, dashboard;
};

// Moves the part's new lines into its log.txt, its tail and the view.
void pump(Part& p, LaunchView& view) {
  std::vector<std::string> lines;
  p.proc->read_lines(&lines);
  for (const auto& l : lines) {
    p.log << l << "\n";
    p.tail.push_back(l);
    if (p.tail.size() > 20) p.tail.erase(p.tail.begin());
    view.line(p.index, l);
  }
  if (!lines.empty()) p.log.flush();
  view.tick();
}

// Whether the part has exited (told to the view once).
bool part_exited(Part& p, LaunchView& view) {
  if (!p.done && p.proc->poll_exit(&p.code)) {
    pump(p, view);
    p.done = true;
    view.exited(p.index, p.code);
  }
  return p.done;
}

// Relays every part's output until the parts [from, to) have exited or the deadline passed.
void wait_parts(std::vector<Part>& parts, LaunchView& view, size_t from, size_t to,
                Clock::time_point deadline) {
  for (;;) {
    bool running = false;
    for (size_t k = 0; k < parts.size(); ++k) {
      if (!parts[k].proc) continue;
      pump(parts[k], view);
      if (k >= from && k < to && !part_exited(parts[k], view)) running = true;
    }
    if (!running || Clock::now() >= deadline) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// Passes `sig` (an orderly stop: SIGINT or SIGTERM, common/stop_signal.h) to the nodes, which
// write their checkpoints, then to the server, and waits up to `timeout_s` in all before
// killing what still runs.
void stop_all(std::vector<Part>& parts, LaunchView& view, int sig, double timeout_s) {
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(timeout_s));
  for (size_t k = 1; k < parts.size(); ++k)
    if (parts[k].proc && parts[k].proc->running()) parts[k].proc->kill(sig);
  wait_parts(parts, view, 1, parts.size(), deadline);
  if (parts[0].proc && parts[0].proc->running()) parts[0].proc->kill(sig);
  wait_parts(parts, view, 0, 1, deadline);
  for (auto& p : parts) {
    if (!p.proc) continue;
    if (!part_exited(p, view)) {
      view.message(fmt::format("launch: {} did not stop within {:.0f} s (--stop-timeout); "
                               "killing it", p.name, timeout_s));
      p.proc->kill(SIGKILL);
    }
    p.code = p.proc->wait();
    if (!p.done) view.exited(p.index, p.code);
    p.done = true;
    pump(p, view);
  }
}

// The number of nodes: --nodes, else spes_config.num_peers when it names several, else 4.
int64_t cluster_size(const LaunchOptions& o, const Config& base) {
  if (o.nodes > 0) return o.nodes;
  return base.spes_config.num_peers > 1 ? base.spes_config.num_peers : 4;
}

// The config every part runs: the user's, for N nodes (and room for one more with
// --add-node-at-round), in spes mode when it said centralized, and with the cores shared among
// the nodes when it leaves the thread count open.
Config cluster_config(const LaunchOptions& o, const Config& base, int64_t N) {
  std::vector<std::string> sets = o.sets;
  sets.push_back("spes_config.num_peers=" + std::to_string(N));
  if (o.add_node_after_round > 0) sets.push_back("spes_config.max_nodes=" + std::to_string(N + 1));
  if (base.spes_config.mode == SyncMode::Centralized) sets.push_back("spes_config.mode=spes");
  if (base.threads == 0)  // share the cores instead of oversubscribing them N times
    sets.push_back("threads=" + std::to_string(std::max(1, cpu_cores() / static_cast<int>(N))));
  return config_load(o.config, sets);
}

// Whether DIR holds an earlier run (server/, node0/).
bool holds_earlier_run(const std::string& dir) {
  return fs::exists(run_layout::cluster_server(dir)) ||
         fs::exists(run_layout::cluster_node(dir, 0));
}

// The directories of an earlier run's parts: server/ and node<i>/.
std::vector<fs::path> part_dirs(const std::string& dir) {
  std::vector<fs::path> parts;
  if (fs::exists(run_layout::cluster_server(dir)))
    parts.push_back(run_layout::cluster_server(dir));
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && n.rfind("node", 0) == 0 && n.size() > 4 &&
        n.find_first_not_of("0123456789", 4) == std::string::npos)
      parts.push_back(e.path());
  }
  return parts;
}

// DIR ready for the run (its lock held by the caller): --resume needs an earlier run and keeps
// it; otherwise an earlier run is refused unless --overwrite, which removes it, but never
// while one of its parts still runs. A refusal changes nothing.
void prepare_out_dir(const LaunchOptions& o) {
  SPES_CHECK(!(o.resume && o.overwrite), "--resume and --overwrite exclude each other: "
             "--resume continues the run in '{}', --overwrite deletes it and starts over", o.out);
  const bool earlier = holds_earlier_run(o.out);
  if (o.resume) {
    SPES_CHECK(earlier, "--resume: '{}' holds no run to continue (no server/ or node0/); "
               "leave out --resume to start one there", o.out);
    return;
  }
  SPES_CHECK(!earlier || o.overwrite, "'{}' holds an earlier run (server/, node0/): pass "
             "--resume to continue it, or --overwrite to delete it and start over (nothing was "
             "changed)", o.out);
  const std::vector<fs::path> parts = part_dirs(o.out);
  for (const auto& d : parts)
    if (const auto h = RunDirLock::holder(d.string()))
      fail("--overwrite: {}; stop that run first (Ctrl-C in its terminal, or kill {}), then "
           "delete it", describe_holder(d.string(), *h), h->pid);
  for (const auto& d : parts) fs::remove_all(d);
}

// The config file of the run: a continued run without --config and --set takes the one it
// started with (DIR/config.yaml).
std::string config_path(const LaunchOptions& o) {
  if (o.resume && o.config.empty() && o.sets.empty() &&
      fs::exists(run_layout::cluster_config(o.out)))
    return run_layout::cluster_config(o.out);
  return o.config;
}

// Writes DIR/config.yaml; a continued run must run the config it started with.
void write_run_config(const LaunchOptions& o, const Config& cfg) {
  const std::string path = run_layout::cluster_config(o.out);
  const std::string yaml = config_to_yaml(cfg);
  if (o.resume && fs::exists(path)) {
    SPES_CHECK(file_read(path) == yaml, "--resume: the config differs from the one the run in "
               "'{}' started with ({}); continue with the same --config and --set, or with "
               "neither (then {} is used)", o.out, path, path);
    return;
  }
  file_write_atomic(path, yaml);
}

// Starts argv as `p`, its output kept in DIR/log.txt.
void start_part(Part& p, size_t index, const std::string& name, const std::string& dir,
                const std::vector<std::string>& argv, const Env& env = {}) {
  fs::create_directories(dir);
  p.name = name;
  p.index = index;
  p.log.open(dir + "/log.txt");
  // Its own process group: a Ctrl-C reaches only the launcher, which passes one stop on.
  p.proc = std::make_unique<Subprocess>(argv, env, /*own_process_group=*/true);
}

void start_server(Part& server, const LaunchOptions& o, const std::string& exe,
                  const std::string& cfg_path) {
  // A continued run's server continues from its state (without --overwrite).
  std::vector<std::string> argv = {exe, "serve", "--config", cfg_path, "--out",
                                   run_layout::cluster_server(o.out), "--listen",
                                   "127.0.0.1:0"};
  if (!o.resume) argv.push_back("--overwrite");
  if (o.keep_uploads) argv.push_back("--keep-uploads");
  start_part(server, 0, "server", run_layout::cluster_server(o.out), argv);
}

// The server's address once it has written server.json; nothing when it exits, the launch is
// interrupted or two minutes pass first.
std::optional<ServerAddress> wait_for_server(Part& server, LaunchView& view,
                                             const std::string& server_dir) {
  const auto t0 = Clock::now();
  for (;;) {
    pump(server, view);
    if (part_exited(server, view) || stop_signal() != 0 ||
        Clock::now() - t0 > std::chrono::seconds(120))
      return std::nullopt;
    const std::string sj = run_layout::server_info(server_dir);
    if (fs::exists(sj)) {
      try {
        const nlohmann::json info = nlohmann::json::parse(file_read(sj));
        ServerAddress a{info.at("address").get<std::string>(), info.value("dashboard", "")};
        // (a continued run's DIR holds the previous server's file until this one writes its own)
        if (!a.address.empty() && info.value("pid", -1) == server.proc->pid()) return a;
      } catch (const std::exception&) {
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// How every node is started: the executable, the run's config, the server's address and the
// node tokens (empty: none configured).
struct NodeLaunch {
  std::string exe, cfg_path, address;
  std::vector<std::string> tokens;
};

// Node i against the server; with node tokens configured, each node gets its own through the
// environment. `arrives`: it joins the running run (`spes node --join-new`).
void start_node(Part& node, int64_t i, const LaunchOptions& o, const NodeLaunch& how,
                bool arrives = false) {
  std::vector<std::string> argv = {how.exe, "node", "--config", how.cfg_path, "--node-id",
                                   std::to_string(i), "--server", how.address, "--out",
                                   run_layout::cluster_node(o.out, i), "--progress", "lines"};
  if (arrives) argv.push_back("--join-new");
  // A continued run's nodes resume from their checkpoints (the default, auto).
  if (!o.resume) argv.insert(argv.end(), {"--resume", "none"});
  if (o.nproc_per_node > 1)
    argv.insert(argv.end(), {"--nproc-per-node", std::to_string(o.nproc_per_node)});
  if (o.disruption.kind == NodeDisruption::Kind::Depart && o.disruption.node == i)
    argv.push_back("--depart");
  start_part(node, static_cast<size_t>(i) + 1, fmt::format("node {}", i),
             run_layout::cluster_node(o.out, i), argv,
             how.tokens.empty() ? Env()
                                : Env{{"SPES_NODE_TOKEN", how.tokens[static_cast<size_t>(i)]}});
}

// Starts the arriving node once its round is published.
void arrive_when_due(std::vector<Part>& parts, LaunchView& view, const LaunchOptions& o,
                     const NodeArrival& a, const NodeLaunch& how, RoundWatch& watch) {
  if (!watch.due()) return;
  view.message("launch: " + a.describe());
  start_node(parts[static_cast<size_t>(a.node) + 1], a.node, o, how, /*arrives=*/true);
}

// Stops the disrupted node once its round is published: SIGKILL, or SIGTERM for a departure.
void disrupt_when_due(std::vector<Part>& parts, LaunchView& view, const NodeDisruption& d,
                      RoundWatch& watch) {
  if (!watch.due()) return;
  Part& p = parts[static_cast<size_t>(d.node) + 1];
  if (p.done) return;
  view.message("launch: " + d.describe());
  p.stopped_on_purpose = true;
  p.proc->kill(d.kind == NodeDisruption::Kind::Kill ? SIGKILL : SIGTERM);
}

// The combined view until every node has exited (the arriving one started when due); returns
// the first failure ("" when none): a part exiting with an error (not the node of a scripted
// disruption), the server gone for 30 s while nodes still run (they lost it), the run ending
// before the arrival's round, or an interrupt.
std::string watch_nodes(std::vector<Part>& parts, LaunchView& view, const LaunchOptions& o,
                        const NodeArrival& arrival, const NodeLaunch& how) {
  std::string failure;
  Clock::time_point server_exit;
  const std::string server_dir = run_layout::cluster_server(o.out);
  RoundWatch disruption(server_dir, o.disruption.active() ? o.disruption.at_round : 0);
  RoundWatch arrival_round(server_dir, arrival.after_round);
  for (;;) {
    disrupt_when_due(parts, view, o.disruption, disruption);
    arrive_when_due(parts, view, o, arrival, how, arrival_round);
    std::vector<pollfd> fds;
    for (auto& p : parts)
      if (p.proc && p.proc->output_fd() >= 0) fds.push_back({p.proc->output_fd(), POLLIN, 0});
    ::poll(fds.data(), fds.size(), 200);
    bool nodes_done = true, waiting_to_start = false;
    for (size_t k = 0; k < parts.size(); ++k) {
      Part& p = parts[k];
      if (!p.proc) {  // the arrival, not started yet
        waiting_to_start = true;
        continue;
      }
      pump(p, view);
      if (!p.done && part_exited(p, view)) {
        if (p.code != 0 && !p.stopped_on_purpose && failure.empty())
          failure = fmt::format("{} exited with code {}", p.name, p.code);
        if (k == 0) server_exit = Clock::now();
      }
      if (k > 0 && !p.done) nodes_done = false;
    }
    if (parts[0].done && !nodes_done && failure.empty() &&
        Clock::now() - server_exit > std::chrono::seconds(30))
      failure = "the sync server exited while nodes were still running";
    if (nodes_done && waiting_to_start && failure.empty())
      failure = fmt::format("the run ended before {}", arrival.describe());
    if (stop_signal() != 0 && failure.empty()) failure = "stopped by " + signal_name(stop_signal());
    if (!failure.empty() || nodes_done) return failure;
  }
}

// Every node left: the server exits by itself within a minute, with code 0 ("" when it did).
std::string wait_for_server_exit(Part& server, LaunchView& view) {
  const auto t0 = Clock::now();
  while (!server.done && Clock::now() - t0 < std::chrono::seconds(60)) {
    pump(server, view);
    part_exited(server, view);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (!server.done) return "the sync server did not exit after every node left";
  if (server.code != 0) return fmt::format("server exited with code {}", server.code);
  return "";
}

// Stops every part and prints the failure with the last lines of each part that failed by
// itself (exited with an error before the stop; `also`: a part that failed without exiting, the
// server that did not start) and where its whole log is; returns the exit code.
int fail_launch(std::vector<Part>& parts, LaunchView& view, const std::string& failure,
                const LaunchOptions& o, std::optional<size_t> also = std::nullopt) {
  std::vector<size_t> failed;
  for (size_t k = 0; k < parts.size(); ++k)
    if ((parts[k].done && parts[k].code != 0 && !parts[k].stopped_on_purpose) || also == k)
      failed.push_back(k);
  stop_all(parts, view, SIGTERM, o.stop_timeout_s);
  view.finish();
  std::fflush(stdout);
  fmt::print(stderr, "launch: FAILED: {}\n", failure);
  for (size_t k : failed) {
    const Part& p = parts[k];
    fmt::print(stderr, "--- last lines of {} (all of them: {}/log.txt) ---\n", p.name,
               k == 0 ? run_layout::cluster_server(o.out)
                      : run_layout::cluster_node(o.out, static_cast<int64_t>(k) - 1));
    for (const auto& l : p.tail) fmt::print(stderr, "{}\n", l);
  }
  return 1;
}

// A stop requested by a signal: passed on to every part (each writes its checkpoint), then
// the exit code 128 + signal.
int stop_launch(std::vector<Part>& parts, LaunchView& view, const LaunchOptions& o) {
  const int sig = stop_signal();
  view.finish();
  std::fflush(stdout);
  fmt::print(stderr, "launch: stopped by {}: passing it to the nodes, then the server (they "
             "write their checkpoints; waiting up to {:.0f} s, --stop-timeout; a second {} "
             "ends everything at once)\n", signal_name(sig), o.stop_timeout_s,
             signal_name(sig));
  std::fflush(stderr);
  stop_all(parts, view, sig, o.stop_timeout_s);
  std::fflush(stdout);
  for (const auto& p : parts)
    if (p.proc) fmt::print(stderr, "launch: {} exited with code {}\n", p.name, p.proc->wait());
  return stop_exit_code(sig);
}

// Writes and prints the end-of-run summary (run_report.h); returns the exit code: 0 when every
// consistency check passed.
int summarise(const LaunchOptions& o, const Config& cfg, int64_t N, const NodeArrival& arrival) {
  nlohmann::json rep = cluster_report(o.out, N + (arrival.active() ? 1 : 0), o.disruption, arrival);
  if (o.keep_uploads) rep["verify"] = verify_kept_rounds(cfg, run_layout::cluster_server(o.out));
  file_write_atomic(run_layout::cluster_summary(o.out), rep.dump(2) + "\n");
  fmt::print("\n=== summary ({}) ===\n{}", o.out, format_cluster_report(rep));
  std::fflush(stdout);
  bool ok = rep["all_nodes_same_model_after_every_sync"].get<bool>();
  if (rep.contains("verify")) ok = ok && rep["verify"]["equal"] == rep["verify"]["checked"];
  if (!ok) fmt::print(stderr, "launch: FAILED: a consistency check did not pass (see above)\n");
  return ok ? 0 : 1;
}
}  // namespace

int launch_cluster(const LaunchOptions& o) {
  const RunDirLock lock(o.out);  // one launcher per DIR; its parts lock their subdirectories
  const Config base = config_load(config_path(o), o.sets);
  const int64_t N = cluster_size(o, base);
  const Config cfg = cluster_config(o, base, N);
  const int64_t rounds = cfg.total_steps() / std::max<int64_t>(1, cfg.spes_config.sync_steps);
  o.disruption.check(N, rounds);
  const NodeArrival arrival{N, o.add_node_after_round};
  arrival.check(rounds);
  const int64_t slots = N + (arrival.active() ? 1 : 0);  // node ids, the arrival's included
  SPES_CHECK((!o.disruption.active() && !arrival.active()) || o.nproc_per_node == 1,
             "--kill-node/--depart-node/--add-node-at-round script one process; leave out "
             "--nproc-per-node (a node of several ranks is not supported there)");
  SPES_CHECK(o.disruption.kind != NodeDisruption::Kind::Kill ||
                 cfg.spes_config.elastic.reassign_after_rounds > 0,
             "--kill-node with spes_config.reassign_after_rounds=0: with a fixed ownership map "
             "the server waits for a killed node to come back, so the run would not end; use "
             "--depart-node (a departing Leave), or reassign_after_rounds > 0");
  prepare_out_dir(o);
  write_run_config(o, cfg);
  const std::string cfg_path = run_layout::cluster_config(o.out);
  const std::string exe = o.executable.empty() ? executable_path() : o.executable;
  install_stop_handlers();

  std::vector<Part> parts(slots + 1);  // the server, then node i at i + 1
  std::vector<std::string> names = {"server"};
  for (int64_t i = 0; i < slots; ++i) names.push_back(fmt::format("node {}", i));
  const int64_t sync_steps = std::max<int64_t>(1, cfg.spes_config.sync_steps);
  LaunchView view(o.progress, names, cfg.total_steps() / sync_steps, o.progress_every_s);
  NodeLaunch how{exe, cfg_path, "", {}};
  if (!cfg.spes_config.transport.auth_tokens_file.empty())
    how.tokens = sync::load_node_tokens(cfg.spes_config.transport.auth_tokens_file,
                                        cfg.spes_config.node_slots());
  view.message(fmt::format("launch: {} nodes, mode {}, {} steps, sync every {} steps, out {}{}",
                           N, cfg.spes_config.mode, cfg.total_steps(),
                           cfg.spes_config.sync_steps, o.out,
                           o.resume ? " (continuing the run there)" : ""));
  view.message(fmt::format("logs: {}/log.txt and {}/log.txt (every line of each part)",
                           run_layout::cluster_server(o.out),
                           N == 1 ? run_layout::cluster_node(o.out, 0)
                                  : run_layout::cluster_node(o.out, 0) + " ... node" +
                                        std::to_string(N - 1)));
  start_server(parts[0], o, exe, cfg_path);
  const std::optional<ServerAddress> server =
      wait_for_server(parts[0], view, run_layout::cluster_server(o.out));
  if (!server && stop_signal() != 0) return stop_launch(parts, view, o);
  if (!server)
    return fail_launch(parts, view, fmt::format("the sync server did not start{}",
                                                parts[0].done ? fmt::format(" (exit code {})",
                                                                            parts[0].code)
                                                              : " within 2 minutes"),
                       o, size_t{0});
  if (!server->dashboard.empty()) view.message("dashboard: " + server->dashboard);
  how.address = server->address;
  for (int64_t i = 0; i < N; ++i) start_node(parts[static_cast<size_t>(i) + 1], i, o, how);

  if (o.disruption.active()) view.message("launch: scripted: " + o.disruption.describe());
  if (arrival.active()) view.message("launch: scripted: " + arrival.describe());
  std::string failure = watch_nodes(parts, view, o, arrival, how);
  if (stop_signal() != 0) return stop_launch(parts, view, o);
  if (failure.empty()) failure = wait_for_server_exit(parts[0], view);
  if (!failure.empty()) return fail_launch(parts, view, failure, o);
  for (auto& p : parts)
    if (p.proc) pump(p, view);
  view.finish();
  return summarise(o, cfg, N, arrival);
}

}  // namespace spes
