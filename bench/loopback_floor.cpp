// What this machine gives any sync transport, measured without the project's code: (1) the
// bytes of one sync round (by default the d_model 512 shape of bench/sync_bench: 4 nodes,
// 160.2 MiB up and 352.2 MiB down per node) moved once over plain loopback TCP sockets, N
// connections at once, each side one thread per connection writing and reading in 2 MiB
// pieces from buffers reused throughout (no serialisation, checksum, check or staging): the
// floor under sync_bench's upload and download times, with the CPU seconds they cost (both
// ends are this process); and (2) the cost of fresh memory:
// writing one byte per page of a new anonymous mapping (the kernel zeroes and maps every page;
// in a virtual machine the host may have to back it too) against writing the same pages again.
// Prints a line per repeat and one JSON line at the end.
//   build/bench/loopback_floor [--nodes 4] [--up-mib 160.2] [--down-mib 352.2] [--repeats 3]
//                              [--touch-mib 512]
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <iostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "round_shape.h"
#include "spes/common/sysinfo.h"
#include "spes/common/timing.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kPiece = 2u << 20;  // the sync protocol's chunk size

[[noreturn]] void fail(const std::string& what) {
  throw std::runtime_error(what + ": " + std::strerror(errno));
}

// Sends (or receives) exactly `bytes` through a reused 2 MiB buffer.
void pump(int fd, uint64_t bytes, bool send) {
  std::vector<char> buf(kPiece, 1);
  size_t at = 0;
  while (bytes > 0) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kPiece - at, bytes));
    const ssize_t k = send ? ::write(fd, buf.data() + at, n) : ::read(fd, buf.data() + at, n);
    if (k <= 0) fail(send ? "write to a loopback socket" : "read from a loopback socket");
    at = (at + static_cast<size_t>(k)) % kPiece;
    bytes -= static_cast<uint64_t>(k);
  }
}

struct Moved {
  double wall_s = 0, cpu_s = 0;  // until the last byte arrived; CPU of both ends
};

// `bytes` over each pair (from[i] -> to[i]) at once.
Moved move_bytes(const std::vector<int>& from, const std::vector<int>& to, uint64_t bytes) {
  const double cpu0 = spes::process_cpu_seconds();
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (size_t i = 0; i < from.size(); ++i) {
    threads.emplace_back(pump, from[i], bytes, true);
    threads.emplace_back(pump, to[i], bytes, false);
  }
  for (auto& t : threads) t.join();
  return {spes::seconds_since(t0), spes::process_cpu_seconds() - cpu0};
}

// Seconds to write one byte into every page of `mib` MiB: a fresh mapping, then the same again.
std::pair<double, double> touch_fresh_and_again(size_t mib) {
  const size_t bytes = mib << 20, page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  void* m = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) fail("mmap of " + std::to_string(mib) + " MiB");
  volatile char* p = static_cast<char*>(m);
  double s[2];
  for (double& t : s) {
    const auto t0 = Clock::now();
    for (size_t i = 0; i < bytes; i += page) p[i] = static_cast<char>(p[i] + 1);
    t = spes::seconds_since(t0);
  }
  ::munmap(m, bytes);
  return {s[0], s[1]};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Loopback TCP and fresh-memory floor under the sync benchmark"};
  spes::bench::RoundShape shape;
  size_t touch_mib = 512;
  shape.add_options(app);
  app.add_option("--touch-mib", touch_mib, "MiB of fresh memory to touch")
      ->check(CLI::Range(1, 1 << 16));
  CLI11_PARSE(app, argc, argv);
  try {
    const int ls = ::socket(AF_INET, SOCK_STREAM, 0);
    if (ls < 0) fail("socket");
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (::bind(ls, reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(ls, 64) != 0 ||
        ::getsockname(ls, reinterpret_cast<sockaddr*>(&a), &len) != 0)
      fail("listen on 127.0.0.1");
    std::vector<int> node_side(shape.nodes), server_side(shape.nodes);
    for (int i = 0; i < shape.nodes; ++i) {
      node_side[i] = ::socket(AF_INET, SOCK_STREAM, 0);
      if (node_side[i] < 0 ||
          ::connect(node_side[i], reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
        fail("connect to 127.0.0.1");
      server_side[i] = ::accept(ls, nullptr, nullptr);
      if (server_side[i] < 0) fail("accept");
    }
    const uint64_t up = shape.up_bytes();
    const uint64_t down = shape.down_bytes();
    std::cout << "loopback_floor: " << shape.nodes << " connections, " << shape.up_mib
              << " MiB up and " << shape.down_mib << " MiB down each per round, "
              << std::thread::hardware_concurrency() << " cores\n";
    nlohmann::json rounds = nlohmann::json::array();
    for (int r = 0; r < shape.repeats; ++r) {
      const Moved u = move_bytes(node_side, server_side, up);
      const Moved d = move_bytes(server_side, node_side, down);
      const double gb = static_cast<double>(shape.nodes) * static_cast<double>(up + down) / 1e9;
      std::cout << "round " << r + 1 << ": upload " << u.wall_s << " s (CPU " << u.cpu_s
                << " s), download " << d.wall_s << " s (CPU " << d.cpu_s << " s), "
                << gb / (u.wall_s + d.wall_s) << " GB/s\n";
      rounds.push_back({{"upload_s", u.wall_s}, {"download_s", d.wall_s},
                        {"upload_cpu_s", u.cpu_s}, {"download_cpu_s", d.cpu_s}});
    }
    for (int fd : node_side) ::close(fd);
    for (int fd : server_side) ::close(fd);
    ::close(ls);
    const auto [fresh_s, again_s] = touch_fresh_and_again(touch_mib);
    const double gib = static_cast<double>(touch_mib) / 1024;
    std::cout << "fresh memory: " << fresh_s / gib << " s per GiB on first touch, "
              << again_s / gib << " s per GiB touched again\n";
    std::cout << nlohmann::json{{"bench", "loopback_floor"},
                                {"nodes", shape.nodes},
                                {"up_mib", shape.up_mib},
                                {"down_mib", shape.down_mib},
                                {"rounds", rounds},
                                {"touch_mib", touch_mib},
                                {"fresh_touch_s_per_gib", fresh_s / gib},
                                {"again_touch_s_per_gib", again_s / gib}}
                     .dump()
              << "\n";
  } catch (const std::exception& e) {
    std::cerr << "loopback_floor: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
