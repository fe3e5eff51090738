// What gRPC itself costs the sync round, measured without the project's round logic: a server
// process of the sync protocol's own service (proto/spes_sync.proto, with the channel settings of
// `spes serve` and `spes node`) whose Upload only counts the chunks' bytes and whose Download
// writes chunks from one buffer set once per stream, and N node threads in this process that
// upload and then download one round's bytes of the sync bench's shape (by default 4 nodes,
// 160.2 MiB up and 352.2 MiB down each) in 2 MiB chunks, all nodes at once. With --checksums
// each side also computes and checks every chunk's XXH3-128, as the protocol requires. No
// checks, staging, aggregation or persistence: what is left of sync_bench's round when all of
// the project's own work is taken away. Reports per repeat the wall time of the uploads and of
// the downloads and the CPU seconds of the server process and of this process in each, and the
// least time those allow on this machine's cores; one JSON line at the end.
//   build/bench/grpc_floor [--nodes 4] [--up-mib 160.2] [--down-mib 352.2] [--repeats 3]
//                          [--checksums] [--channel-arg KEY=INT ...]
// --channel-arg sets a gRPC channel argument (integer) on both sides, to try transport settings.
// (`grpc_floor --serve-floor BYTES_DOWN ...` is the server process it starts.)
#include <CLI/CLI.hpp>
#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "round_shape.h"
#include "spes/cluster/subprocess.h"
#include "spes/common/sysinfo.h"
#include "spes/common/timing.h"
#include "spes/sync/wire/checksum.h"
#include "spes/sync/wire/protocol.h"
#include "spes_sync.grpc.pb.h"

namespace pb = spes::sync::v1;
using Clock = std::chrono::steady_clock;

namespace {

constexpr size_t kChunk = spes::sync::kChunkBytes;  // what spes node sends per chunk

// The server: the protocol's service with nothing behind Upload and Download but the bytes.
class FloorService final : public pb::SpesSync::Service {
 public:
  FloorService(uint64_t down_bytes, bool checksums)
      : down_bytes_(down_bytes), checksums_(checksums), chunk_(kChunk, '\1') {}

  grpc::Status Upload(grpc::ServerContext*, grpc::ServerReader<pb::UploadChunk>* reader,
                      pb::UploadReply* reply) override {
    pb::UploadChunk c;
    uint64_t bytes = 0;
    while (reader->Read(&c)) {
      if (checksums_ && spes::sync::chunk_checksum(c.data()) != c.checksum())
        return {grpc::StatusCode::DATA_LOSS, "chunk checksum mismatch"};
      bytes += c.data().size();
    }
    reply->set_accepted(true);
    reply->set_bytes_received(bytes);
    return grpc::Status::OK;
  }

  grpc::Status Download(grpc::ServerContext*, const pb::DownloadRequest* req,
                        grpc::ServerWriter<pb::DownloadChunk>* writer) override {
    pb::DownloadChunk c;
    c.set_round(req->round());
    c.set_total_bytes(down_bytes_);
    for (uint64_t at = 0; at < down_bytes_; at += kChunk) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, down_bytes_ - at));
      if (c.data().size() != n) c.set_data(chunk_.data(), n);
      c.set_offset(at);
      // The server computes each chunk's checksum as it sends it (it is not stored).
      if (checksums_) c.set_checksum(spes::sync::chunk_checksum(c.data()));
      if (!writer->Write(c)) return {grpc::StatusCode::CANCELLED, "the node went away"};
    }
    return grpc::Status::OK;
  }

 private:
  uint64_t down_bytes_;
  bool checksums_;
  std::string chunk_;
};

using ChannelArgs = std::vector<std::pair<std::string, int>>;

// "KEY=INT" options as (key, value); throws naming the option that is not one.
ChannelArgs parse_channel_args(const std::vector<std::string>& options) {
  ChannelArgs out;
  for (const auto& o : options) {
    const size_t eq = o.find('=');
    const std::string value = eq == std::string::npos ? "" : o.substr(eq + 1);
    char* end = nullptr;
    errno = 0;
    const long v = value.empty() ? 0 : std::strtol(value.c_str(), &end, 10);
    if (eq == 0 || value.empty() || *end != '\0' || errno != 0 || v < INT_MIN || v > INT_MAX)
      throw std::runtime_error("--channel-arg '" + o + "' is not KEY=INT, e.g. "
                               "grpc.http2.lookahead_bytes=4194304");
    out.emplace_back(o.substr(0, eq), static_cast<int>(v));
  }
  return out;
}

int serve(uint64_t down_bytes, bool checksums, const ChannelArgs& channel_args) {
  FloorService service(down_bytes, checksums);
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.SetMaxReceiveMessageSize(spes::sync::kMaxMessageBytes);
  b.SetMaxSendMessageSize(spes::sync::kMaxMessageBytes);
  for (const auto& [key, value] : channel_args) b.AddChannelArgument(key, value);
  b.RegisterService(&service);
  auto server = b.BuildAndStart();
  if (!server || port <= 0) {
    std::cerr << "grpc_floor: cannot listen on 127.0.0.1\n";
    return 1;
  }
  std::cout << "port " << port << std::endl;
  server->Wait();  // until the bench kills this process
  return 0;
}

std::unique_ptr<pb::SpesSync::Stub> connect(const std::string& address,
                                            const ChannelArgs& channel_args) {
  grpc::ChannelArguments args;  // as SyncClient
  args.SetMaxReceiveMessageSize(spes::sync::kMaxMessageBytes);
  args.SetMaxSendMessageSize(spes::sync::kMaxMessageBytes);
  for (const auto& [key, value] : channel_args) args.SetInt(key, value);
  auto channel =
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(30)))
    throw std::runtime_error("cannot connect to the floor server at " + address);
  return pb::SpesSync::NewStub(channel);
}

// One node's upload: `bytes` in chunks filled from a buffer (as spes node fills each chunk from
// its tensors: one copy into the message).
void upload(pb::SpesSync::Stub& stub, uint64_t bytes, bool checksums) {
  const std::string buf(kChunk, '\2');
  grpc::ClientContext ctx;
  pb::UploadReply reply;
  auto writer = stub.Upload(&ctx, &reply);
  pb::UploadChunk c;
  c.set_total_bytes(bytes);
  for (uint64_t at = 0; at < bytes; at += kChunk) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, bytes - at));
    c.set_data(buf.data(), n);
    c.set_offset(at);
    if (checksums) c.set_checksum(spes::sync::chunk_checksum(c.data()));
    if (!writer->Write(c)) break;
  }
  writer->WritesDone();
  const grpc::Status st = writer->Finish();
  if (!st.ok() || reply.bytes_received() != bytes)
    throw std::runtime_error("upload failed: " + st.error_message());
}

// One node's download, each chunk's checksum checked when the server sends them.
void download(pb::SpesSync::Stub& stub, uint64_t bytes, bool checksums) {
  grpc::ClientContext ctx;
  pb::DownloadRequest req;
  req.set_round(1);
  auto reader = stub.Download(&ctx, req);
  pb::DownloadChunk c;
  uint64_t got = 0;
  while (reader->Read(&c)) {
    if (checksums && spes::sync::chunk_checksum(c.data()) != c.checksum())
      throw std::runtime_error("download chunk checksum mismatch");
    got += c.data().size();
  }
  const grpc::Status st = reader->Finish();
  if (!st.ok() || got != bytes) throw std::runtime_error("download failed: " + st.error_message());
}

struct Phase {
  double wall_s = 0, server_cpu_s = 0, nodes_cpu_s = 0;
};

// Runs `work(i)` on every node at once; wall time and both processes' CPU seconds.
template <class F>
Phase timed(std::vector<std::unique_ptr<pb::SpesSync::Stub>>& stubs, pid_t server, F work) {
  Phase p;
  p.server_cpu_s = -spes::process_cpu_seconds(server);
  p.nodes_cpu_s = -spes::process_cpu_seconds();
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  std::atomic<bool> failed{false};
  for (size_t i = 0; i < stubs.size(); ++i)
    threads.emplace_back([&, i] {
      try {
        work(*stubs[i]);
      } catch (const std::exception& e) {
        std::cerr << "grpc_floor: node " << i << ": " << e.what() << "\n";
        failed = true;
      }
    });
  for (auto& t : threads) t.join();
  if (failed) throw std::runtime_error("a transfer failed");
  p.wall_s = spes::seconds_since(t0);
  p.server_cpu_s += spes::process_cpu_seconds(server);
  p.nodes_cpu_s += spes::process_cpu_seconds();
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gRPC's own cost under the sync benchmark's round"};
  spes::bench::RoundShape shape;
  bool checksums = false;
  uint64_t serve_down = 0;
  std::vector<std::string> arg_options;
  shape.add_options(app);
  app.add_flag("--checksums", checksums, "XXH3-128 of every chunk on both sides, as the protocol");
  app.add_option("--channel-arg", arg_options, "a gRPC channel argument KEY=INT, both sides");
  app.add_option("--serve-floor", serve_down, "run as the floor server (internal)");
  CLI11_PARSE(app, argc, argv);
  try {
    const ChannelArgs channel_args = parse_channel_args(arg_options);
    if (serve_down > 0) return serve(serve_down, checksums, channel_args);
    const uint64_t up = shape.up_bytes();
    const uint64_t down = shape.down_bytes();
    std::vector<std::string> argv_server = {"/proc/self/exe", "--serve-floor",
                                            std::to_string(down)};
    if (checksums) argv_server.push_back("--checksums");
    for (const auto& o : arg_options) argv_server.insert(argv_server.end(), {"--channel-arg", o});
    spes::Subprocess server(argv_server);
    std::string address;
    const auto t_start = Clock::now();
    while (address.empty()) {
      std::vector<std::string> lines;
      const bool open = server.read_lines(&lines);
      for (const auto& l : lines)
        if (l.rfind("port ", 0) == 0) address = "127.0.0.1:" + l.substr(5);
      if (!address.empty()) break;
      if (!open || spes::seconds_since(t_start) > 60)
        throw std::runtime_error("the floor server did not start");
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::vector<std::unique_ptr<pb::SpesSync::Stub>> stubs;
    for (int i = 0; i < shape.nodes; ++i) stubs.push_back(connect(address, channel_args));
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    std::cout << "grpc_floor: " << shape.nodes << " nodes, " << shape.up_mib << " MiB up and "
              << shape.down_mib << " MiB down each per round in " << (kChunk >> 20)
              << " MiB chunks, checksums " << (checksums ? "on" : "off") << ", " << cores << " cores";
    for (const auto& o : arg_options) std::cout << ", " << o;
    std::cout << "\n";
    nlohmann::json rounds = nlohmann::json::array();
    auto to_json = [](const Phase& p) {
      return nlohmann::json{{"wall_s", p.wall_s}, {"server_cpu_s", p.server_cpu_s},
                            {"nodes_cpu_s", p.nodes_cpu_s}};
    };
    for (int r = 0; r < shape.repeats; ++r) {
      const Phase u = timed(stubs, server.pid(), [&](auto& s) { upload(s, up, checksums); });
      const Phase d = timed(stubs, server.pid(), [&](auto& s) { download(s, down, checksums); });
      const double cpu = u.server_cpu_s + u.nodes_cpu_s + d.server_cpu_s + d.nodes_cpu_s;
      std::printf("round %d: upload %.2f s (CPU %.2f s server + %.2f s nodes), download %.2f s "
                  "(CPU %.2f s + %.2f s); %.2f s in all, at least %.2f s on %u cores\n",
                  r + 1, u.wall_s, u.server_cpu_s, u.nodes_cpu_s, d.wall_s, d.server_cpu_s,
                  d.nodes_cpu_s, u.wall_s + d.wall_s, cpu / cores, cores);
      rounds.push_back({{"upload", to_json(u)}, {"download", to_json(d)},
                        {"round_s", u.wall_s + d.wall_s}, {"cpu_s", cpu}});
    }
    stubs.clear();
    server.kill(SIGTERM);
    server.wait();
    std::cout << nlohmann::json{{"bench", "grpc_floor"},
                                {"nodes", shape.nodes},
                                {"up_mib", shape.up_mib},
                                {"down_mib", shape.down_mib},
                                {"chunk_bytes", kChunk},
                                {"checksums", checksums},
                                {"channel_args", arg_options},
                                {"cores", cores},
                                {"rounds", rounds}}
                     .dump()
              << "\n";
  } catch (const std::exception& e) {
    std::cerr << "grpc_floor: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
