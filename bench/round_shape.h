// The round whose bytes the transport floors move (bench/loopback_floor, bench/grpc_floor) and
// its command-line options: by default one plain round of bench/sync_bench's d_model 512 shape,
// 4 nodes each uploading 160.2 MiB and downloading 352.2 MiB, all at once, timed 3 times.
#pragma once
#include <CLI/CLI.hpp>

#include <cstdint>

namespace spes::bench {

struct RoundShape {
  int nodes = 4, repeats = 3;
  double up_mib = 160.2, down_mib = 352.2;

  void add_options(CLI::App& app) {
    app.add_option("--nodes", nodes, "nodes at once (the sync bench's nodes)")
        ->check(CLI::Range(1, 64));
    app.add_option("--up-mib", up_mib, "MiB each node uploads per round")
        ->check(CLI::PositiveNumber);
    app.add_option("--down-mib", down_mib, "MiB each node downloads per round")
        ->check(CLI::PositiveNumber);
    app.add_option("--repeats", repeats, "rounds to time")->check(CLI::Range(1, 100));
  }
  uint64_t up_bytes() const { return static_cast<uint64_t>(up_mib * (1 << 20)); }
  uint64_t down_bytes() const { return static_cast<uint64_t>(down_mib * (1 << 20)); }
};

}  // namespace spes::bench
