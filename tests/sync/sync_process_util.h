// Helpers of the sync tests that run real processes (`spes serve`, `spes node`, `spes status`):
// a child process whose output is collected (Proc), polling until a condition or a timeout,
// starting a server and reading the address it bound from DIR/server.json.
#pragma once
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "spes/cluster/subprocess.h"

namespace spes::sync::testing {

inline std::string read_or_empty(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A child process whose output is collected; `log()` gives it all so far.
struct Proc {
  std::string name;
  std::unique_ptr<Subprocess> p;
  std::vector<std::string> lines;
  int code = -1;
  bool exited = false;
  Proc(std::string n, const std::vector<std::string>& argv,
       const std::vector<std::pair<std::string, std::string>>& env = {})
      : name(std::move(n)), p(std::make_unique<Subprocess>(argv, env)) {}
  bool poll() {
    p->read_lines(&lines);
    if (!exited && p->poll_exit(&code)) {
      exited = true;
      while (p->read_lines(&lines)) {
      }
    }
    return exited;
  }
  bool saw(const std::string& s) const {
    for (const auto& l : lines)
      if (l.find(s) != std::string::npos) return true;
    return false;
  }
  std::string log() const {
    std::string s;
    for (const auto& l : lines) s += "[" + name + "] " + l + "\n";
    return s;
  }
  void kill9() {
    p->kill(SIGKILL);
    code = p->wait();
    exited = true;
    while (p->read_lines(&lines)) {
    }
  }
};

// Polls every process until `done` or the timeout; false on timeout.
inline bool pump_until(std::vector<Proc*> procs, const std::function<bool()>& done,
                       double timeout_s) {
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - t0 < std::chrono::duration<double>(timeout_s)) {
    for (Proc* p : procs) p->poll();
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

inline std::string all_logs(const std::vector<Proc*>& procs) {
  std::string s;
  for (const Proc* p : procs) s += p->log();
  return s;
}

// `extra`: more arguments of `spes serve`; `wrapper`: a command it runs under (prlimit ...).
inline std::unique_ptr<Proc> start_server(const std::string& cfg, const std::string& dir,
                                          const std::string& listen = "127.0.0.1:0",
                                          const std::vector<std::string>& extra = {},
                                          const std::vector<std::string>& wrapper = {}) {
  std::vector<std::string> argv = wrapper;
  argv.insert(argv.end(), {SPES_BINARY, "serve", "--config", cfg, "--out", dir,
                           "--listen", listen});
  argv.insert(argv.end(), extra.begin(), extra.end());
  return std::make_unique<Proc>("server", argv);
}

// Waits for DIR/server.json written by the server process `srv` (a restarted server rewrites
// it: `pid` tells the runs apart).
inline std::string server_address(Proc& srv, const std::string& dir) {
  std::string address;
  pump_until({&srv}, [&] {
    if (srv.exited || !std::filesystem::exists(dir + "/server.json")) return srv.exited;
    const auto j = nlohmann::json::parse(read_or_empty(dir + "/server.json"), nullptr, false);
    if (!j.is_object() || j.value("pid", -1) != srv.p->pid()) return false;
    address = j["address"];
    return true;
  }, 120);
  return address;
}

}  // namespace spes::sync::testing
