// Sync benchmark: a real `spes serve` process on loopback and N simulated nodes (threads of this
// process, each with its own copy of the model and a gRPC client) that join, then for several
// rounds upload their trainable tensors, wait for the round and download what they lack,
// exactly as `spes node` does but without training. Reports per round the latency (every node
// starts uploading -> every node has its download) in three phases: the uploads (until the
// server has accepted every one), the publication (the server's part after the last upload,
// rounds.jsonl publish_s; the node whose upload completes the round gets its reply only then)
// and the downloads (published -> every node has its download; sync_bench.json also gives the
// round's start and publication on CLOCK_MONOTONIC), the bytes per node, the
// throughput and the CPU seconds the round cost the server process and the nodes (this
// process), and the server's peak RSS against the model's fp32 size; first, the time of the
// model digest on one thread and on all cores. Defaults: the d_model 512 shape of
// bench/train_bench (about 117M parameters, 8 experts) with 4 nodes owning 2 experts each.
//   build/bench/sync_bench [--nodes 4] [--rounds 6] [--merge-interval 2] [--dtype fp32|bf16]
//                          [--compression none|bf16|int8|topk] [--wire-coding auto|zstd|raw]
//                          [--topk-density D] [--topk-bits B]
// Each round every node adds seeded Gaussian noise (standard deviation 1e-4) to its trainable
// tensors: real training moves weights less uniformly, so the coded sizes here are indicative
// (docs/PERFORMANCE.md, "Chunk coding", gives the ratios on deltas of a real run).
// With --compression the simulated nodes upload quantised (topk: sparse) deltas (with error
// feedback) from the
// published model and download the round's delta, which they apply and check against the
// published digest (outside the timed download), as spes node does. Without compression only
// the bytes and the server's work are representative (the nodes do not load what they
// download). Bytes are counted as they cross the wire: with chunk coding (--wire-coding, as
// spes_config.wire_coding: auto codes int8 and bf16 transfers with zstd) the coded sizes.
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <condition_variable>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "spes/cluster/subprocess.h"
#include "spes/common/error.h"
#include "spes/common/memory_policy.h"
#include "spes/common/strings.h"
#include "spes/common/sysinfo.h"
#include "spes/io/config.h"
#include "spes/io/files.h"
#include "spes/model/ownership.h"
#include "spes/model/registry.h"
#include "spes/model/transformer.h"
#include "spes/sync/node/client.h"
#include "spes/sync/node/download.h"
#include "spes/sync/round/delta_upload.h"
#include "spes/sync/round/plan.h"
#include "spes/sync/wire/framing.h"
#include "spes/sync/wire/topk_codec.h"
#include "sync_shape.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  int64_t nodes = 4, rounds = 6, merge_interval = 2;
  spes::bench::SyncShape shape;
  std::string dtype = "fp32";
  std::string compression = "none";
  double topk_density = 1.0 / 64;
  int64_t topk_bits = 2;
  std::string wire_coding = "auto";
  std::string spes;  // path of the spes executable (default: ../spes next to this bench)
  std::string out = "runs/sync_bench";
};

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "usage: sync_bench [--nodes N] [--rounds R] [--merge-interval I] [--dtype fp32|bf16]"
               "\n  [--compression none|bf16|int8|topk] [--topk-density D] [--topk-bits B] [--wire-coding auto|zstd|raw] [--d-model D] [--layers L] [--heads H] [--experts E] [--hidden F] "
               "[--vocab V]\n  [--spes PATH] [--out DIR]\n");
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) usage();
    const std::string v = argv[++i];
    if (k == "--nodes") a.nodes = std::stoll(v);
    else if (k == "--rounds") a.rounds = std::stoll(v);
    else if (k == "--merge-interval") a.merge_interval = std::stoll(v);
    else if (k == "--dtype") a.dtype = v;
    else if (k == "--compression") a.compression = v;
    else if (k == "--topk-density") a.topk_density = std::stod(v);
    else if (k == "--topk-bits") a.topk_bits = std::stoll(v);
    else if (k == "--wire-coding") a.wire_coding = v;
    else if (a.shape.parse(k, v)) continue;
    else if (k == "--spes") a.spes = v;
    else if (k == "--out") a.out = v;
    else usage();
  }
  return a;
}

spes::Config bench_config(const Args& a) {
  spes::Config c;
  a.shape.apply(c);
  c.data.paths = {"unused-by-the-server"};
  c.spes_config.mode = "spes";
  c.spes_config.num_peers = a.nodes;
  c.spes_config.sync_steps = 1;  // round r is step r
  c.spes_config.transfer.dtype = a.dtype;
  c.spes_config.transfer.compression = a.compression;
  c.spes_config.transfer.topk_density = a.topk_density;
  c.spes_config.transfer.topk_bits = a.topk_bits;
  c.spes_config.transfer.wire_coding = a.wire_coding;
  c.spes_config.merging.interval = a.merge_interval;
  c.spes_config.merging.alpha_start = 0.01;
  c.spes_config.merging.decay_steps = 10000;
  c.spes_config.merging.topk = std::min<int64_t>(4, a.shape.experts - 1);
  c.max_duration = std::to_string(a.rounds);
  return c;
}

// All simulated nodes start each round together (std::barrier is C++20; the project is C++17).
class Barrier {
 public:
  explicit Barrier(int64_t n) : n_(n) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t gen = generation_;
    if (++waiting_ == n_) {
      waiting_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != gen; });
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t n_, waiting_ = 0, generation_ = 0;
};

// A steady-clock time in seconds on its own epoch (CLOCK_MONOTONIC on Linux).
double monotonic_s(Clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

struct NodeTimes {
  std::vector<double> seen_s, done_s;  // from the round's start: publication seen, download done
  std::vector<uint64_t> up_bytes, down_bytes;
};

}  // namespace

int main(int argc, char** argv) {
  spes::keep_freed_heap_memory();  // as the spes binary does
  try {
    const Args a = parse(argc, argv);
    torch::set_num_threads(1);
    const spes::Config cfg = bench_config(a);
    fs::remove_all(a.out);
    fs::create_directories(a.out);
    const std::string cfg_path = a.out + "/config.yaml";
    spes::file_write_atomic(cfg_path, spes::config_to_yaml(cfg));
    const std::string exe =
        a.spes.empty() ? (fs::path(spes::executable_path()).parent_path().parent_path() /
                          "spes").string()
                       : a.spes;
    SPES_CHECK(fs::exists(exe), "spes executable '{}' not found; pass --spes PATH", exe);

    // The nodes' models first (the server's initial model comes from its own seed; nodes load
    // it on join as `spes node` does with compression; without it only the bytes matter).
    const spes::Ownership own = spes::Ownership::from_config(cfg);
    std::vector<std::unique_ptr<spes::Transformer>> models;
    std::vector<std::unique_ptr<spes::ParamRegistry>> regs;
    for (int64_t i = 0; i < a.nodes; ++i) {
      models.push_back(std::make_unique<spes::Transformer>(cfg.model));
      regs.push_back(std::make_unique<spes::ParamRegistry>(*models.back(), cfg, own, i));
    }
    const int64_t P = models[0]->num_params();
    const double fp32_mib = 4.0 * static_cast<double>(P) / (1 << 20);
    fmt::print("sync_bench: {:.1f}M parameters ({:.0f} MiB fp32), {} nodes, {} rounds, {} "
               "transfers, compression {}, chunk coding {}, merging every {} rounds\n", P / 1e6,
               fp32_mib, a.nodes, a.rounds, a.dtype, a.compression,
               cfg.spes_config.transfer.codes_chunks() ? "zstd" : "raw", a.merge_interval);
    // The model digest every node computes after each download and the server as it persists:
    // per tensor on every core (sync protocol 5) against one thread.
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    auto digest_s = [&](int threads) {
      torch::set_num_threads(threads);
      const auto t0 = Clock::now();
      (void)regs[0]->weights_sha256();
      return std::chrono::duration<double>(Clock::now() - t0).count();
    };
    const double digest_one = digest_s(1), digest_all = digest_s(cores);
    torch::set_num_threads(1);
    fmt::print("model digest: {:.3f} s on {} threads, {:.3f} s on 1\n", digest_all, cores,
               digest_one);

    spes::Subprocess server({exe, "serve", "--config", cfg_path, "--out",
                                   a.out + "/server", "--listen", "127.0.0.1:0", "--overwrite"});
    std::string address;
    const auto t_start = Clock::now();
    while (address.empty()) {
      std::vector<std::string> lines;
      server.read_lines(&lines);
      int code = 0;
      SPES_CHECK(!server.poll_exit(&code), "the sync server exited with code {} at start", code);
      SPES_CHECK(Clock::now() - t_start < std::chrono::seconds(120), "the server did not start");
      try {
        address = nlohmann::json::parse(spes::file_read(a.out + "/server/server.json"))
                      .at("address").get<std::string>();
      } catch (const std::exception&) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }

    const spes::sync::WireDtype wire =
        spes::sync::wire_dtype_of(spes::Choice<spes::TransferDtype>(a.dtype));
    std::vector<NodeTimes> times(a.nodes);
    std::vector<double> round_s(a.rounds + 1, 0);
    std::vector<Clock::time_point> round_t0(a.rounds + 1);
    // CPU seconds each round costs the server process and this one (the nodes' transfers and
    // checks): read at the round's start and end, while every node waits at the barrier.
    std::vector<double> server_cpu(a.rounds + 1, 0), nodes_cpu(a.rounds + 1, 0);
    const pid_t server_pid = server.pid();
    Barrier sync_point(a.nodes);
    std::vector<std::thread> threads;
    for (int64_t i = 0; i < a.nodes; ++i) {
      threads.emplace_back([&, i] {
        try {
          spes::sync::NodeId id{i, static_cast<uint64_t>(0x5eed0000 + i), ""};
          spes::sync::SyncClient client(address, id);
          client.set_chunk_coding(cfg.spes_config.transfer.codes_chunks());
          SPES_CHECK(client.wait_connected(60), "node {}: cannot connect to {}", i, address);
          const spes::ParamRegistry& reg = *regs[i];
          client.join(spes::sync::node_join_info(cfg, reg, id, 0));
          auto discard = [](const char*, size_t) {};
          auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(1000 + i));
          const spes::TransferSettings& transfer = cfg.spes_config.transfer;
          spes::sync::DeltaUpload delta(transfer.compression, spes::sync::topk_params(transfer),
                                        transfer.topk_decay);
          if (delta.enabled()) {  // deltas need the published model: load it, as spes node
            spes::sync::Download d(reg, 0, spes::sync::Selection::All, wire);
            d.attempt(client);
            delta.set_base(reg, true);
          } else {
            client.download(0, spes::sync::Selection::All, [](uint64_t) {}, discard);
          }
          for (int64_t r = 1; r <= a.rounds; ++r) {
            {  // a small random change (seeded per node), so every round aggregates real
               // updates whose deltas code (chunk coding) like noise, not like a constant
              torch::NoGradGuard ng;
              for (const auto& e : reg.entries())
                if (e.trainable)
                  e.tensor.add_(torch::randn(e.tensor.sizes(), gen, torch::kFloat32), 1e-4);
            }
            sync_point.arrive_and_wait();
            if (i == 0) {
              round_t0[r] = Clock::now();
              server_cpu[r] = -spes::process_cpu_seconds(server_pid);
              nodes_cpu[r] = -spes::process_cpu_seconds();
            }
            sync_point.arrive_and_wait();
            const spes::sync::UploadMeta meta{i, r, r, 1000, id.incarnation, reg.fingerprint()};
            const auto up = client.upload(
                r, r, delta.enabled() ? delta.encode(reg, meta)
                                      : spes::sync::node_upload_writer(reg, meta, wire));
            spes::sync::RoundStatus st;
            do {
              st = client.wait_round(r, spes::sync::kMaxWaitMs);
            } while (!st.published);
            const auto t2 = Clock::now();
            const uint64_t wire_before = client.download_wire_bytes();
            bool applied_delta = false;
            if (delta.enabled()) {  // as spes node: the upload as rebuilt, then the delta
              delta.apply_rebuilt(reg);
              spes::sync::Download d(reg, r, spes::sync::Selection::ForNode, wire, &delta, r - 1);
              d.attempt(client);
              applied_delta = d.receiver.is_delta();
            } else {
              client.download(r, spes::sync::Selection::ForNode, [](uint64_t) {}, discard);
            }
            const auto t3 = Clock::now();
            const uint64_t down = client.download_wire_bytes() - wire_before;
            if (delta.enabled()) {
              SPES_CHECK(applied_delta && reg.weights_sha256() == st.model_sha256, "node {}: "
                         "round {}: the delta did not give the published model", i, r);
              delta.set_base(reg, false);
            }
            auto secs = [](auto x, auto y) { return std::chrono::duration<double>(y - x).count(); };
            times[i].seen_s.push_back(secs(round_t0[r], t2));
            times[i].done_s.push_back(secs(round_t0[r], t3));
            times[i].up_bytes.push_back(up.bytes_sent);
            times[i].down_bytes.push_back(down);
            sync_point.arrive_and_wait();
            if (i == 0) {
              round_s[r] = secs(round_t0[r], Clock::now());
              server_cpu[r] += spes::process_cpu_seconds(server_pid);
              nodes_cpu[r] += spes::process_cpu_seconds();
            }
          }
          client.leave(a.rounds, "benchmark finished");
        } catch (const std::exception& e) {  // the other threads would wait forever
          std::fprintf(stderr, "sync_bench: node %lld: %s\n", static_cast<long long>(i), e.what());
          std::_Exit(1);
        }
      });
    }
    for (auto& t : threads) t.join();
    const int code = server.wait();
    SPES_CHECK(code == 0, "the sync server exited with code {}", code);

    const auto rounds = spes::read_jsonl(a.out + "/server/rounds.jsonl");
    double server_rss = 0;
    for (const auto& r : rounds) server_rss = std::max(server_rss, r.value("peak_rss_mb", 0.0));
    fmt::print("{:>5} {:>6} {:>9} {:>10} {:>10} {:>10} {:>12} {:>12} {:>11} {:>11} {:>10}\n",
               "round", "merge", "round_s", "uploads_s", "publish_s", "download_s", "up/node",
               "down/node", "throughput", "server_cpu", "nodes_cpu");
    nlohmann::json report = {{"params", P}, {"nodes", a.nodes}, {"dtype", a.dtype},
                             {"digest_seconds_one_thread", digest_one},
                             {"digest_seconds_all_threads", digest_all},
                             {"compression", a.compression},
                             {"rounds", nlohmann::json::array()}};
    double max_round = 0, sum_round = 0, sum_server_cpu = 0, sum_nodes_cpu = 0;
    for (int64_t r = 1; r <= a.rounds; ++r) {
      double seen = round_s[r], done = 0;
      uint64_t total = 0, up_sum = 0, down_sum = 0;
      for (const auto& t : times) {
        up_sum += t.up_bytes[r - 1];
        down_sum += t.down_bytes[r - 1];
        seen = std::min(seen, t.seen_s[r - 1]);
        done = std::max(done, t.done_s[r - 1]);
        total += t.up_bytes[r - 1] + t.down_bytes[r - 1];
      }
      SPES_CHECK(r - 1 < static_cast<int64_t>(rounds.size()), "rounds.jsonl has no line for "
                 "round {}", r);
      const nlohmann::json& line = rounds[r - 1];
      const bool merged = line.value("alpha", 0.0) > 0;
      // The server's publish_s ends when the round became visible, which the first node to see
      // it saw (a long-poll wakes at once): the uploads were all in publish_s before that.
      const double publish_s = line.value("publish_s", 0.0);
      const double up_s = seen - publish_s, down_s = done - seen;
      const double mibps = static_cast<double>(total) / (1 << 20) / round_s[r];
      fmt::print("{:>5} {:>6} {:>9.2f} {:>10.2f} {:>10.2f} {:>10.2f} {:>12} {:>12} {:>5.0f} MiB/s "
                 "{:>9.2f} s {:>8.2f} s\n",
                 r, merged ? "yes" : "no", round_s[r], up_s, publish_s, down_s,
                 spes::human_bytes(static_cast<double>(times[0].up_bytes[r - 1])),
                 spes::human_bytes(static_cast<double>(times[0].down_bytes[r - 1])), mibps,
                 server_cpu[r], nodes_cpu[r]);
      max_round = std::max(max_round, round_s[r]);
      sum_round += round_s[r];
      sum_server_cpu += server_cpu[r];
      sum_nodes_cpu += nodes_cpu[r];
      report["rounds"].push_back({{"round", r}, {"merged", merged}, {"seconds", round_s[r]},
                                  {"bytes_up_node0", times[0].up_bytes[r - 1]},
                                  {"bytes_down_node0", times[0].down_bytes[r - 1]},
                                  {"bytes_up_per_node_mean", up_sum / a.nodes},
                                  {"bytes_down_per_node_mean", down_sum / a.nodes},
                                  {"mib_per_s", mibps},
                                  {"uploads_seconds", up_s},
                                  {"publish_seconds", publish_s},
                                  {"download_seconds", down_s},
                                  // On CLOCK_MONOTONIC (perf record -k CLOCK_MONOTONIC), to cut
                                  // a profile at the round's phases.
                                  {"start_monotonic_s", monotonic_s(round_t0[r])},
                                  {"published_monotonic_s", monotonic_s(round_t0[r]) + seen},
                                  {"server_cpu_seconds", server_cpu[r]},
                                  {"nodes_cpu_seconds", nodes_cpu[r]}});
    }
    report["round_seconds_mean"] = sum_round / static_cast<double>(a.rounds);
    report["round_seconds_max"] = max_round;
    const double rounds_n = static_cast<double>(a.rounds);
    report["server_cpu_seconds_mean"] = sum_server_cpu / rounds_n;
    report["nodes_cpu_seconds_mean"] = sum_nodes_cpu / rounds_n;
    report["cores"] = cores;
    report["server_peak_rss_mb"] = server_rss;
    report["model_fp32_mib"] = fp32_mib;
    spes::file_write_atomic(a.out + "/sync_bench.json", report.dump(2) + "\n");
    fmt::print("round latency {:.2f} s mean, {:.2f} s max | server peak RSS {:.0f} MiB = {:.2f} x "
               "the fp32 model ({:.0f} MiB) | bench process peak RSS {:.0f} MiB\n",
               sum_round / rounds_n, max_round, server_rss, server_rss / fp32_mib, fp32_mib,
               spes::peak_rss_mb());
    // What bounds the round on this machine: the CPU time both sides need on its cores.
    fmt::print("CPU per round {:.2f} s server + {:.2f} s nodes on {} cores (a round needs at least "
               "{:.2f} s here while the nodes share the server's cores)\n",
               sum_server_cpu / rounds_n, sum_nodes_cpu / rounds_n, cores,
               (sum_server_cpu + sum_nodes_cpu) / rounds_n / cores);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sync_bench: %s\n", e.what());
    return 1;
  }
}
