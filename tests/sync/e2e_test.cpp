// End to end over loopback with real processes: `spes prepare` on small real text, then
// `spes serve --keep-uploads` and 3 `spes node` processes started with different seeds, then
// `spes launch` with 2 nodes. Checks: every node starts from the server's model; after every
// sync all nodes report the published digest; frozen experts change only through a sync;
// upload, gradient and optimizer bytes match the trainable set (S + X/N) exactly, download
// bytes match P - X/N (P in merge rounds); `spes aggregate` on the kept uploads reproduces
// each published model byte for byte. With spes_config.compression int8: the same digests,
// uploads about a quarter of fp32, and a final loss close to the uncompressed run's. With
// spes_config.overlap: rounds applied while training, inside their window, with the same
// digests, and bit-reproducible with a fixed delay.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "io/tensorboard_read_back.h"
#include "spes/cluster/run_report.h"
#include "spes/cluster/subprocess.h"
#include "spes/io/files.h"
#include "spes/sync/round/aggregate.h"

using namespace spes;
using namespace spes::sync;
namespace fs = std::filesystem;

namespace {

std::string g_dir;  // shared by the tests of this suite: corpus, tokens, config

// Runs a child to completion (with a timeout); returns its exit code and output.
int run_child(const std::vector<std::string>& argv, std::string* output, double timeout_s = 120) {
  Subprocess p(argv);
  std::vector<std::string> lines;
  const auto t0 = std::chrono::steady_clock::now();
  int code = -1;
  while (!p.poll_exit(&code)) {
    p.read_lines(&lines);
    if (std::chrono::steady_clock::now() - t0 > std::chrono::duration<double>(timeout_s)) {
      p.kill(SIGKILL);
      code = p.wait();
      lines.push_back("(killed after timeout)");
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  while (p.read_lines(&lines)) {
  }
  for (const auto& l : lines) *output += l + "\n";
  return code;
}

std::string read_file_or_empty(const std::string& path);

// Whole lines in a file another process appends to (its last line may be being written).
size_t whole_lines(const std::string& path) {
  const std::string text = read_file_or_empty(path);
  return static_cast<size_t>(std::count(text.begin(), text.end(), '\n'));
}

// Relays `p`'s output into *lines until DIR/metrics.jsonl holds `steps` lines; false when `p`
// exits first or five minutes pass.
bool wait_for_steps(Subprocess& p, const std::string& run_dir, size_t steps,
                    std::vector<std::string>* lines) {
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - t0 < std::chrono::minutes(5)) {
    p.read_lines(lines);
    if (p.poll_exit(nullptr)) return false;
    if (whole_lines(run_dir + "/metrics.jsonl") >= steps) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// Relays `p`'s output into *lines until it exits (SIGKILL after timeout_s); its exit code.
int finish_child(Subprocess& p, std::vector<std::string>* lines, double timeout_s = 300) {
  const auto t0 = std::chrono::steady_clock::now();
  int code = -1;
  while (!p.poll_exit(&code)) {
    p.read_lines(lines);
    if (std::chrono::steady_clock::now() - t0 > std::chrono::duration<double>(timeout_s)) {
      p.kill(SIGKILL);
      lines->push_back("(killed after timeout)");
      return p.wait();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  while (p.read_lines(lines)) {
  }
  return code;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string s;
  for (const auto& l : lines) s += l + "\n";
  return s;
}

std::string read_file_or_empty(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

class SyncEndToEnd : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    g_dir = (fs::temp_directory_path() /
             ("spes_e2e_" + std::to_string(::getpid()) + "_" + std::to_string(std::random_device{}())))
                .string();
    fs::create_directories(g_dir);
    // Small real English text: the license texts every Debian system ships; paragraphs are
    // documents. Falls back to generated sentences elsewhere.
    std::ofstream corpus(g_dir + "/corpus.txt");
    size_t bytes = 0;
    for (const char* f : {"GPL-3", "GPL-2", "LGPL-2.1", "GFDL-1.3", "Apache-2.0", "MPL-2.0",
                          "Artistic", "CC0-1.0"}) {
      const std::string text = read_file_or_empty(std::string("/usr/share/common-licenses/") + f);
      corpus << text << "\n\n";
      bytes += text.size();
    }
    if (bytes < 50000) {
      std::mt19937 rng(1);
      const char* w[] = {"the", "node", "trains", "a", "model", "and", "sends", "its", "experts",
                         "to", "server", "which", "averages", "shared", "weights", "every",
                         "round", "then", "all", "nodes", "load", "result"};
      for (int d = 0; d < 400; ++d) {
        for (int s = 0; s < 8; ++s) {
          for (int k = 0; k < 10; ++k) corpus << w[rng() % 22] << ' ';
          corpus << ".\n";
        }
        corpus << "\n";
      }
    }
    corpus.close();
    std::string out;
    const int code = run_child({SPES_BINARY, "prepare", "--input", g_dir + "/corpus.txt", "--out",
                                g_dir + "/tokens", "--vocab-size", "512"},
                               &out);
    ASSERT_EQ(code, 0) << out;
    std::ofstream cfg(g_dir + "/config.yaml");
    cfg << "model:\n  d_model: 32\n  n_layers: 2\n  n_heads: 2\n  mlp_hidden_size: 64\n"
           "  moe_num_experts: 6\n  moe_top_k: 2\n  vocab_size: 512\n  max_sequence_length: 32\n"
           "  rope_theta: 10000\n"
           "optimizer:\n  learning_rate: 0.003\n"
           "scheduler:\n  t_warmup: 5\n"
           "data:\n  paths: [" << g_dir << "/tokens]\n  validation_fraction: 0.05\n"
           "spes_config:\n  mode: spes\n  num_peers: 3\n  sync_steps: 10\n"
           "  merge_interval: 20\n  merge_alpha_start: 0.1\n  merge_decay_steps: 1000\n"
           "  merge_topk: 2\n"
           "max_duration: 30\nglobal_train_batch_size: 4\ndevice_train_microbatch_size: 4\n"
           "eval_interval: 0\neval_batches: 2\nthreads: 1\n";
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    if (::testing::UnitTest::GetInstance()->failed_test_count() == 0) fs::remove_all(g_dir, ec);
  }
};

TEST_F(SyncEndToEnd, ServerAndThreeNodesWithDifferentSeeds) {
  const std::string cfg_path = g_dir + "/config.yaml";
  const std::string srv = g_dir + "/server";
  Subprocess server({SPES_BINARY, "serve", "--config", cfg_path, "--out", srv, "--listen",
                     "127.0.0.1:0", "--keep-uploads"});
  std::string address;
  std::vector<std::string> server_lines;
  for (int i = 0; i < 600 && address.empty(); ++i) {
    server.read_lines(&server_lines);
    ASSERT_FALSE(server.poll_exit(nullptr)) << "server died";
    if (fs::exists(srv + "/server.json"))
      address = nlohmann::json::parse(file_read(srv + "/server.json"))["address"];
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_FALSE(address.empty()) << "server did not start";
  std::vector<std::unique_ptr<Subprocess>> nodes;
  for (int i = 0; i < 3; ++i)
    nodes.push_back(std::make_unique<Subprocess>(std::vector<std::string>{
        SPES_BINARY, "node", "--config", cfg_path, "--node-id", std::to_string(i), "--server",
        address, "--out", g_dir + "/node" + std::to_string(i), "--progress", "none", "--set",
        "seed=" + std::to_string(100 + 17 * i)}));
  std::vector<std::vector<std::string>> node_lines(3);
  const auto t0 = std::chrono::steady_clock::now();
  int done = 0;
  std::vector<int> codes(3, -1);
  while (done < 3 && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(120)) {
    for (int i = 0; i < 3; ++i) {
      nodes[i]->read_lines(&node_lines[i]);
      if (codes[i] < 0 && nodes[i]->poll_exit(&codes[i])) ++done;
    }
    server.read_lines(&server_lines);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int i = 0; i < 3; ++i) {
    while (nodes[i]->read_lines(&node_lines[i])) {
    }
    std::string log;
    for (const auto& l : node_lines[i]) log += l + "\n";
    ASSERT_EQ(codes[i], 0) << "node " << i << ":\n" << log;
  }
  int server_code = -1;
  for (int i = 0; i < 200 && !server.poll_exit(&server_code); ++i) {
    server.read_lines(&server_lines);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  while (server.read_lines(&server_lines)) {
  }
  std::string server_log;
  for (const auto& l : server_lines) server_log += l + "\n";
  EXPECT_EQ(server_code, 0) << "the server exits once every node has left:\n" << server_log;

  // --- the server's rounds and the nodes' sync records -----------------------------------
  const Config cfg = config_load(cfg_path);
  const auto rounds = read_jsonl(srv + "/rounds.jsonl");
  ASSERT_EQ(rounds.size(), 3u);
  EXPECT_EQ(rounds[1]["step"], 20);
  EXPECT_GT(rounds[1]["alpha"].get<double>(), 0);  // 20 is a merge point (interval 20)
  EXPECT_EQ(rounds[0]["alpha"].get<double>(), 0);
  Metadata md0;
  safetensors_load(srv + "/rounds/0/published.safetensors", &md0);
  const std::string round0 = md0.at("model_sha256");

  SyncModel layout(cfg);
  int64_t S = 0, X = 0;
  for (const auto& t : layout.plan().tensors()) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    (t.role == ParamRole::Expert ? X : S) += n;
  }
  const int64_t P = S + X, own = X / 3;
  for (int i = 0; i < 3; ++i) {
    const auto lines = read_jsonl(g_dir + "/node" + std::to_string(i) + "/metrics.jsonl");
    ASSERT_EQ(lines.size(), 30u);
    // Different seeds, same start: the server's round-0 model, downloaded whole at join (a
    // node with another seed initialised other weights).
    const auto& join = lines[0]["sync_join"];
    EXPECT_EQ(join["model_sha256"], round0) << "node " << i;
    EXPECT_GT(join["bytes_down"].get<int64_t>(), 4 * P) << "node " << i;
    // Trainable set = shared + own experts; gradients and AdamW moments exactly for it.
    EXPECT_EQ(join["trainable_numel"].get<int64_t>(), S + own);
    EXPECT_EQ(join["frozen_numel"].get<int64_t>(), X - own);
    EXPECT_EQ(join["grad_numel"].get<int64_t>(), S + own);
    EXPECT_EQ(join["optimizer_state_bytes"].get<int64_t>(), 2 * 4 * (S + own));
    EXPECT_EQ(join["upload_data_bytes"].get<int64_t>(), 4 * (S + own));
    std::string frozen_after = join["frozen_sha256"];
    for (const auto& l : lines) {
      if (!l.contains("sync")) continue;
      const auto& s = l["sync"];
      const int64_t r = s["round"];
      EXPECT_EQ(s["model_sha256"], rounds[r - 1]["model_sha256"]) << "node " << i << " round " << r;
      // Upload: S + X/N fp32 values plus a small header; download: P - own (P when merged).
      const int64_t up = s["bytes_up"], down = s["bytes_down"];
      EXPECT_GT(up, 4 * (S + own));
      EXPECT_LT(up, 4 * (S + own) + 16384);
      const int64_t want_down = 4 * (r == 2 ? P : P - own);
      EXPECT_GT(down, want_down) << "round " << r;
      EXPECT_LT(down, want_down + 16384) << "round " << r;
      EXPECT_EQ(rounds[r - 1]["bytes_in_per_node"][i].get<int64_t>(), up);
      EXPECT_EQ(rounds[r - 1]["bytes_out_per_node"][i].get<int64_t>(), down);
      // Frozen experts change only through a sync.
      EXPECT_EQ(s["frozen_sha256_before"], frozen_after) << "node " << i << " round " << r;
      frozen_after = s["frozen_sha256_after"];
    }
    EXPECT_TRUE(lines.back().contains("val_loss"));
  }
  // Final validation loss: identical models at step 30 (a sync step) give identical losses.
  const auto rep = cluster_report(g_dir, 3);
  EXPECT_TRUE(rep["all_nodes_same_model_after_every_sync"].get<bool>()) << rep.dump(2);
  EXPECT_EQ(rep["nodes"][0]["final_val_loss"], rep["nodes"][2]["final_val_loss"]);

  // --- `spes aggregate` on the kept uploads reproduces the published models ----------------
  for (int r = 1; r <= 3; ++r) {
    const std::string rd = srv + "/rounds/" + std::to_string(r);
    const std::string out = g_dir + "/aggregate" + std::to_string(r) + ".safetensors";
    std::string log;
    std::vector<std::string> argv = {SPES_BINARY, "aggregate", "--config", cfg_path, "--step",
                                     std::to_string(10 * r), "--out", out, "--previous",
                                     srv + "/rounds/" + std::to_string(r - 1) +
                                         "/published.safetensors"};
    for (int i = 2; i >= 0; --i) argv.push_back(rd + "/node" + std::to_string(i) + ".safetensors");
    ASSERT_EQ(run_child(argv, &log), 0) << log;
    EXPECT_EQ(sha256_hex(file_read(out)), sha256_hex(file_read(rd + "/published.safetensors")))
        << "round " << r;
  }
}

// Compressed uploads (spes_config.compression int8, docs/PROTOCOL.md "Compressed deltas"):
// the same job as a cluster of 3 with and without compression. With int8 every node holds the
// published digest after every sync (each download being the round's int8 delta, applied
// and checked against that digest), `spes aggregate` on the kept compressed uploads
// reproduces every published model, uploads and downloads are about a quarter of fp32, and the final
// validation loss is finite and close to the uncompressed run's.
TEST_F(SyncEndToEnd, Int8DeltasKeepEveryNodeOnThePublishedModel) {
  std::map<std::string, nlohmann::json> rep;
  std::map<std::string, std::vector<int64_t>> up, down;  // bytes per sync of node 0
  for (const std::string comp : {"none", "int8"}) {
    const std::string dir = g_dir + "/compression_" + comp;
    std::string out;
    ASSERT_EQ(run_child({SPES_BINARY, "launch", "--config", g_dir + "/config.yaml", "--nodes",
                         "3", "--out", dir, "--keep-uploads", "--set",
                         "spes_config.compression=" + comp},
                        &out, 600),
              0)
        << out;
    rep[comp] = cluster_report(dir, 3);
    EXPECT_TRUE(rep[comp]["all_nodes_same_model_after_every_sync"].get<bool>()) << comp;
    const auto summary = nlohmann::json::parse(file_read(dir + "/summary.json"));
    EXPECT_EQ(summary["verify"]["equal"], 3) << comp << ": " << summary["verify"].dump();
    const auto rounds = read_jsonl(dir + "/server/rounds.jsonl");
    ASSERT_EQ(rounds.size(), 3u) << comp;
    for (int i = 0; i < 3; ++i) {
      const auto lines = read_jsonl(dir + "/node" + std::to_string(i) + "/metrics.jsonl");
      for (const auto& l : lines) {
        if (!l.contains("sync")) continue;
        const auto& s = l["sync"];
        const int64_t r = s["round"];
        EXPECT_FALSE(s.value("caught_up", false)) << comp << " node " << i << " round " << r;
        EXPECT_EQ(s["model_sha256"], rounds[r - 1]["model_sha256"]) << comp << " node " << i;
        EXPECT_EQ(s["compression"], comp);
        // With int8 every node held the previous round, so every download is the delta.
        EXPECT_EQ(s.value("download_delta", false), comp == "int8") << "node " << i << " round "
                                                                    << r;
        EXPECT_FALSE(s.value("delta_refused", true)) << comp << " node " << i << " round " << r;
        if (i == 0) up[comp].push_back(s["bytes_up"].get<int64_t>());
        if (i == 0) down[comp].push_back(s["bytes_down"].get<int64_t>());
      }
    }
  }
  ASSERT_EQ(up["none"].size(), 3u);
  ASSERT_EQ(up["int8"].size(), 3u);
  ASSERT_EQ(down["none"].size(), 3u);
  ASSERT_EQ(down["int8"].size(), 3u);
  // Payload: 1 byte per value + 4 bytes per block of 256 (more for tensors under 256 values)
  // against 4 bytes per value; each stream adds its header (the int8 one names the scales too).
  std::map<std::string, int64_t> data;
  for (const std::string comp : {"none", "int8"})
    data[comp] = read_jsonl(g_dir + "/compression_" + comp + "/node0/metrics.jsonl")[0]
                     ["sync_join"]["upload_data_bytes"].get<int64_t>();
  const double ratio = static_cast<double>(data["int8"]) / static_cast<double>(data["none"]);
  EXPECT_GT(ratio, 0.25);
  EXPECT_LT(ratio, 0.27);
  for (size_t r = 0; r < 3; ++r) {
    std::printf("round %zu node 0 bytes_up: none %lld, int8 %lld (payload %lld vs %lld)\n", r + 1,
                static_cast<long long>(up["none"][r]), static_cast<long long>(up["int8"][r]),
                static_cast<long long>(data["none"]), static_cast<long long>(data["int8"]));
    EXPECT_GT(up["int8"][r], data["int8"]);
    EXPECT_LT(up["int8"][r], data["int8"] + 16384) << "round " << r + 1;
    // Downloads: the int8 delta against fp32 tensors (each without the node's own experts).
    std::printf("round %zu node 0 bytes_down: none %lld, int8 %lld\n", r + 1,
                static_cast<long long>(down["none"][r]), static_cast<long long>(down["int8"][r]));
    EXPECT_LT(down["int8"][r], down["none"][r] * 0.35) << "round " << r + 1;
  }
  for (int i = 0; i < 3; ++i) {
    const double a = rep["none"]["nodes"][i]["final_val_loss"].get<double>();
    const double b = rep["int8"]["nodes"][i]["final_val_loss"].get<double>();
    EXPECT_TRUE(std::isfinite(b));
    EXPECT_NEAR(b, a, 0.05) << "node " << i;
  }
}

// spes_config.overlap: each node trains on while its round is in flight and applies the round
// inside the round's window (after the step of its upload, before the next sync step); every
// node reports the published digest of every round, and the round at the run's last step
// blocks. With a fixed delay (overlap_delay_steps 3, int8 deltas) every round is applied
// exactly 3 steps after its upload, and a second run publishes the same models bit for bit.
TEST_F(SyncEndToEnd, OverlappedRoundsApplyWhileTrainingAndEndOnThePublishedModel) {
  struct Run {
    std::string name;
    std::vector<std::string> sets;
    int64_t delay;  // 0: when the round arrives
  };
  const std::vector<std::string> fixed = {"spes_config.overlap=true",
                                          "spes_config.overlap_delay_steps=3",
                                          "spes_config.compression=int8"};
  const std::vector<Run> runs = {{"overlap", {"spes_config.overlap=true"}, 0},
                                 {"delay_a", fixed, 3},
                                 {"delay_b", fixed, 3}};
  std::map<std::string, std::vector<std::string>> published;
  for (const Run& run : runs) {
    const std::string dir = g_dir + "/overlap_" + run.name;
    std::vector<std::string> argv = {SPES_BINARY, "launch", "--config", g_dir + "/config.yaml",
                                     "--nodes", "3", "--out", dir};
    for (const auto& kv : run.sets) argv.insert(argv.end(), {"--set", kv});
    std::string out;
    ASSERT_EQ(run_child(argv, &out, 600), 0) << out;
    const nlohmann::json rep = cluster_report(dir, 3);
    EXPECT_TRUE(rep["all_nodes_same_model_after_every_sync"].get<bool>()) << run.name;
    const auto rounds = read_jsonl(dir + "/server/rounds.jsonl");
    ASSERT_EQ(rounds.size(), 3u) << run.name;
    for (const auto& r : rounds) published[run.name].push_back(r["model_sha256"]);
    for (int i = 0; i < 3; ++i) {
      const auto lines = read_jsonl(dir + "/node" + std::to_string(i) + "/metrics.jsonl");
      int syncs = 0;
      double first_loss = NAN;
      for (const auto& l : lines) {
        if (std::isnan(first_loss) && l.contains("loss")) first_loss = l["loss"].get<double>();
        if (!l.contains("sync")) continue;
        ++syncs;
        const auto& s = l["sync"];
        const int64_t r = s["round"], step = s["step"];
        const std::string where = run.name + " node " + std::to_string(i) + " round " +
                                  std::to_string(r);
        EXPECT_FALSE(s.value("caught_up", false)) << where;
        EXPECT_EQ(s["model_sha256"], rounds[r - 1]["model_sha256"]) << where;
        EXPECT_EQ(step, 10 * r) << where;
        EXPECT_GE(s["blocked_s"].get<double>(), 0.0) << where;
        if (r == 3) {  // the run's last step: the round blocks
          EXPECT_FALSE(s["overlap"].get<bool>()) << where;
          EXPECT_EQ(l["step"], step) << where;
          continue;
        }
        EXPECT_TRUE(s["overlap"].get<bool>()) << where;
        const int64_t applied = s["applied_step"];
        EXPECT_EQ(l["step"], applied) << where;
        EXPECT_GT(applied, step) << where << ": applied in the step of its upload";
        EXPECT_LE(applied, step + 9) << where << ": applied after the next sync step";
        if (run.delay > 0) EXPECT_EQ(applied, step + run.delay) << where;
        EXPECT_GT(s["overlap_bytes"].get<int64_t>(), 0) << where;
      }
      EXPECT_EQ(syncs, 3) << run.name << " node " << i;
      const double final_loss = rep["nodes"][i]["final_val_loss"].get<double>();
      EXPECT_TRUE(std::isfinite(final_loss)) << run.name;
      EXPECT_LT(final_loss, first_loss) << run.name << " node " << i << ": did not train";
    }
  }
  EXPECT_EQ(published["delay_a"], published["delay_b"]);
}

TEST_F(SyncEndToEnd, LaunchRunsAClusterAndSummarises) {
  std::string out;
  const std::string dir = g_dir + "/launch";
  const int code = run_child({SPES_BINARY, "launch", "--config", g_dir + "/config.yaml",
                              "--nodes", "2", "--out", dir, "--keep-uploads", "--set",
                              "max_duration=20", "--set", "spes_config.merge_interval=0"},
                             &out);
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, ::testing::HasSubstr("every node held the published model after every sync: yes"));
  // Not a terminal: the plain view, a line for the whole cluster every --progress-every
  // seconds (10 by default) and the last one at the end, instead of every part's lines; those
  // are in each part's log.txt.
  EXPECT_THAT(out, ::testing::HasSubstr("logs: " + dir + "/server/log.txt"));
  EXPECT_THAT(out, ::testing::HasSubstr("round 2/2 | step 20/20 | loss "));
  EXPECT_THAT(out, ::testing::Not(::testing::HasSubstr("[node 1] step")));
  EXPECT_THAT(out, ::testing::Not(::testing::HasSubstr("[info]")));
  for (const std::string part : {"server", "node0", "node1"})
    EXPECT_THAT(file_read(dir + "/" + part + "/log.txt"),
                ::testing::HasSubstr(part == "server" ? "round 2 (step 20) published"
                                                      : "step 20/20 | loss"));
  const auto summary = nlohmann::json::parse(file_read(dir + "/summary.json"));
  EXPECT_EQ(summary["server"]["rounds"], 2);
  EXPECT_EQ(summary["verify"]["equal"], 2);
  EXPECT_EQ(summary["nodes"].size(), 2u);
  EXPECT_TRUE(fs::exists(dir + "/node1/metrics.jsonl"));
  // TensorBoard's reader finds the server's round figures and each node's step figures, at
  // their steps, equal to rounds.jsonl's and metrics.jsonl's.
  const nlohmann::json tb_server = spes::test::read_tensorboard(dir + "/server");
  if (tb_server.contains("skip")) {
    std::printf("(TensorBoard read-back skipped: %s)\n", tb_server["skip"].dump().c_str());
  } else {
    EXPECT_TRUE(spes::test::scalars_equal_lines(
        tb_server, read_jsonl(dir + "/server/rounds.jsonl"),
        {{"round", "round/number"}, {"seconds", "round/seconds"}, {"bytes_in", "round/bytes_in"},
         {"bytes_out", "round/bytes_out"}, {"publish_s", "round/publish_s"}}));
    EXPECT_EQ(tb_server["scalars"]["round/nodes"], nlohmann::json::parse("[[10, 2, " +
        read_jsonl(dir + "/server/rounds.jsonl")[0]["time"].dump() + "], [20, 2, " +
        read_jsonl(dir + "/server/rounds.jsonl")[1]["time"].dump() + "]]"));
    std::vector<nlohmann::json> steps;
    for (const auto& l : read_jsonl(dir + "/node1/metrics.jsonl"))
      if (l.contains("loss")) steps.push_back(l);
    EXPECT_TRUE(spes::test::scalars_equal_lines(spes::test::read_tensorboard(dir + "/node1"), steps,
                                                {{"loss", "train/loss"}, {"lr", "train/lr"}}));
  }
  // A failing part fails the launch: an impossible config for the nodes.
  std::string out2;
  const int bad = run_child({SPES_BINARY, "launch", "--config", g_dir + "/config.yaml", "--nodes",
                             "4", "--out", g_dir + "/launch_bad"},
                            &out2);
  EXPECT_NE(bad, 0) << out2;  // 6 experts cannot be split over 4 nodes
  // The failing part's own words are shown, and its last lines with where its whole log is.
  EXPECT_THAT(out2, ::testing::HasSubstr("[server] error: spes_config: 6 experts cannot be split"));
  EXPECT_THAT(out2, ::testing::HasSubstr("launch: FAILED: the sync server did not start (exit code 1)"));
  EXPECT_THAT(out2, ::testing::ContainsRegex("--- last lines of server \\(all of them: .*/launch_bad/server/log.txt\\) ---"));
}

// `spes launch` of 3 nodes on DIR for `steps` steps, without merging or a summary, with the
// disruption (or arrival) flags `extra`.
std::vector<std::string> disrupted_launch_argv(const std::string& dir, int steps,
                                               const std::vector<std::string>& extra) {
  std::vector<std::string> a = {SPES_BINARY, "launch", "--config", g_dir + "/config.yaml",
                                "--nodes", "3", "--out", dir,
                                "--set", "max_duration=" + std::to_string(steps),
                                "--set", "spes_config.merge_interval=0", "--no-summary"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// A scripted departure (`spes launch --depart-node 2 --at-round 2`): node 2 leaves for good
// once round 2 is published, its experts go to the live nodes (an ownership epoch in
// rounds.jsonl), the others run to the end on the published model, the launch succeeds, its
// summary marks the node and its offline re-check of every kept round (under each round's
// map) equals the published models; the disruptions that could not end or name nothing are refused before
// anything runs.
TEST_F(SyncEndToEnd, LaunchDepartsANodeOnPurposeAndTheOthersTakeItsExperts) {
  const std::string dir = g_dir + "/launch_depart";
  auto with = [&](const std::vector<std::string>& extra) {
    return disrupted_launch_argv(dir, 50, extra);
  };
  std::string out;
  const int code = run_child(with({"--depart-node", "2", "--at-round", "2", "--keep-uploads",
                                   "--set", "spes_config.reassign_after_rounds=1"}), &out);
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, ::testing::HasSubstr("launch: node 2 departing (SIGTERM, --depart) after round 2"));
  EXPECT_THAT(out, ::testing::HasSubstr("every node held the published model after every sync: yes"));
  const auto summary = nlohmann::json::parse(file_read(dir + "/summary.json"));
  EXPECT_EQ(summary["server"]["rounds"], 5);
  // The re-check of kept rounds replays the rounds after the handoff under the new map.
  EXPECT_EQ(summary["verify"]["checked"], 5);
  EXPECT_EQ(summary["verify"]["equal"], 5) << summary["verify"].dump();
  EXPECT_EQ(summary["nodes"][2]["disrupted"]["after_round"], 2);
  EXPECT_FALSE(summary["nodes"][0].contains("disrupted"));
  EXPECT_LT(summary["nodes"][2]["steps"].get<int64_t>(), 50);
  EXPECT_EQ(summary["nodes"][0]["steps"], 50);
  std::set<std::pair<int64_t, int64_t>> handed;  // (layer, expert) from node 2
  for (const auto& r : read_jsonl(dir + "/server/rounds.jsonl"))
    for (const auto& h : r.value("handoffs", nlohmann::json::array())) {
      EXPECT_EQ(h["from"], 2);
      EXPECT_NE(h["to"], 2);
      handed.insert({h["layer"].get<int64_t>(), h["expert"].get<int64_t>()});
    }
  EXPECT_EQ(handed.size(), 4u);  // node 2's two experts of each of the 2 layers
  for (const auto& [flags, want] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--kill-node", "2", "--at-round", "2", "--set", "spes_config.reassign_after_rounds=0"},
            "--kill-node with spes_config.reassign_after_rounds=0"},
           {{"--kill-node", "3", "--at-round", "2"}, "the cluster has nodes 0 to 2"},
           {{"--depart-node", "1", "--at-round", "5"}, "the run has rounds 1 to 5"},
           {{"--at-round", "2"}, "--at-round: needs --kill-node or --depart-node"}}) {
    std::string refused;
    EXPECT_NE(run_child(with(flags), &refused), 0) << refused;
    EXPECT_THAT(refused, ::testing::HasSubstr(want));
    EXPECT_TRUE(fs::exists(dir + "/summary.json")) << "a refusal changed the earlier run";
  }
}

TEST_F(SyncEndToEnd, LaunchAddsANodeMidRunThatTakesExpertsFromTheOthers) {
  // 40 short rounds: the cluster runs on while node 3's process starts, as a real one would.
  const std::string dir = g_dir + "/launch_arrival";
  auto with = [&](const std::vector<std::string>& extra) {
    return disrupted_launch_argv(dir, 400, extra);
  };
  std::string out;
  const int code = run_child(with({"--add-node-at-round", "2", "--keep-uploads"}), &out);
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, ::testing::HasSubstr("launch: node 3 joins (--join-new) after round 2"));
  EXPECT_THAT(out, ::testing::HasSubstr("every node held the published model after every sync: yes"));
  const auto summary = nlohmann::json::parse(file_read(dir + "/summary.json"));
  EXPECT_EQ(summary["server"]["rounds"], 40);
  EXPECT_EQ(summary["verify"]["equal"], 40) << summary["verify"].dump();
  ASSERT_EQ(summary["nodes"].size(), 4u);
  const auto& arrived = summary["nodes"][3]["arrived"];
  EXPECT_EQ(arrived["after_round"], 2);
  // It joined on a published round after the second and synced every round from then on.
  const int64_t joined_at = arrived["joined_at_round"].get<int64_t>();
  EXPECT_GE(joined_at, 2);
  ASSERT_LT(joined_at, 39) << "node 3 joined too late to take experts: " << summary.dump();
  EXPECT_EQ(summary["nodes"][3]["syncs"], 40 - joined_at);
  EXPECT_EQ(summary["nodes"][0]["syncs"], 40);
  // From the boundary after its join node 3 trains at least one expert of every layer, each
  // taken from another node because it arrived.
  std::set<int64_t> layers;
  for (const auto& r : read_jsonl(dir + "/server/rounds.jsonl"))
    for (const auto& h : r.value("handoffs", nlohmann::json::array())) {
      EXPECT_EQ(h["to"], 3) << h.dump();
      EXPECT_NE(h["from"], 3) << h.dump();
      layers.insert(h["layer"].get<int64_t>());
    }
  EXPECT_EQ(layers.size(), 2u);  // both layers of the test model
  std::string refused;
  EXPECT_NE(run_child(with({"--add-node-at-round", "40"}), &refused), 0) << refused;
  EXPECT_THAT(refused, ::testing::HasSubstr("--add-node-at-round 40: the run has rounds 1 to 40"));
}

// Runs argv on a pseudo-terminal of 160 columns (a terminal as a user's) until it exits or
// timeout_s passes; returns its exit code and *out all it wrote.
int run_on_terminal(const std::vector<std::string>& argv, std::string* out, double timeout_s) {
  winsize ws{};
  ws.ws_row = 50;
  ws.ws_col = 160;
  int master = -1;
  const pid_t pid = ::forkpty(&master, nullptr, nullptr, &ws);
  if (pid < 0) return -1;
  if (pid == 0) {
    ::setenv("TERM", "xterm-256color", 1);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  const auto t0 = std::chrono::steady_clock::now();
  char buf[4096];
  for (;;) {
    pollfd pfd{master, POLLIN, 0};
    if (::poll(&pfd, 1, 200) > 0) {
      const ssize_t n = ::read(master, buf, sizeof buf);
      if (n > 0) {
        out->append(buf, static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      break;  // EIO: the child side is closed
    }
    if (std::chrono::steady_clock::now() - t0 > std::chrono::duration<double>(timeout_s)) {
      ::kill(pid, SIGKILL);
      *out += "(killed after timeout)";
      break;
    }
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  ::close(master);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST_F(SyncEndToEnd, LaunchOnATerminalRedrawsOneLinePerPartInPlace) {
  const std::string dir = g_dir + "/launch_tty";
  std::string out;
  const int code = run_on_terminal({SPES_BINARY, "launch", "--config", g_dir + "/config.yaml",
                                    "--nodes", "2", "--out", dir, "--no-summary", "--set",
                                    "max_duration=20", "--set", "spes_config.merge_interval=0"},
                                   &out, 300);
  ASSERT_EQ(code, 0) << out;
  // The header, the logs and the dashboard, then the rows redrawn in place: the cursor goes
  // back up over the 4 rows (server, 2 nodes, the cluster) and clears each before drawing it.
  EXPECT_THAT(out, ::testing::HasSubstr("launch: 2 nodes"));
  EXPECT_THAT(out, ::testing::HasSubstr("logs: " + dir + "/server/log.txt"));
  EXPECT_THAT(out, ::testing::HasSubstr("dashboard: http://127.0.0.1:"));
  EXPECT_THAT(out, ::testing::HasSubstr("\r\x1b[4A\x1b[2Kserver  | "));
  // The last frame: every part at its end, then the summary below it.
  const size_t last = out.rfind("\r\x1b[4A");
  ASSERT_NE(last, std::string::npos) << out;
  const std::string frame = out.substr(last, out.find("=== summary", last) - last);
  EXPECT_THAT(frame, ::testing::HasSubstr("server  | round 2/2 published (2 nodes) | 2 joined, 2 left"));
  for (int i = 0; i < 2; ++i)
    EXPECT_THAT(frame, ::testing::ContainsRegex(fmt::format(
        "node {}  \\| \\[#+\\] 20/20 \\| loss [0-9.]+ \\| val [0-9.]+ \\| [0-9]+ tok/s \\| round 2/2 \\| done", i)))
        << frame;
  EXPECT_THAT(out.substr(last), ::testing::HasSubstr("every node held the published model after every sync: yes"));
  // No part's info or progress line is relayed.
  EXPECT_THAT(out, ::testing::Not(::testing::HasSubstr("[node 0]")));
  EXPECT_THAT(out, ::testing::Not(::testing::HasSubstr("[info]")));
}

TEST_F(SyncEndToEnd, CtrlCStopsTheLaunchInOrderAndEveryNodeCheckpoints) {
  const std::string dir = g_dir + "/launch_stop";
  Subprocess launch({SPES_BINARY, "launch", "--config", g_dir + "/config.yaml", "--nodes", "2",
                     "--out", dir, "--no-summary", "--set", "max_duration=100000", "--set",
                     "spes_config.merge_interval=0"});
  std::vector<std::string> lines;
  ASSERT_TRUE(wait_for_steps(launch, dir + "/node0", 12, &lines)) << joined(lines);
  launch.kill(SIGINT);  // the launcher only: its parts have their own process groups
  EXPECT_EQ(finish_child(launch, &lines), 130) << joined(lines);
  const std::string out = joined(lines);
  EXPECT_THAT(out, ::testing::HasSubstr("launch: stopped by SIGINT"));
  for (int i = 0; i < 2; ++i) {
    const std::string node = dir + "/node" + std::to_string(i);
    EXPECT_THAT(out, ::testing::HasSubstr(fmt::format("launch: node {} exited with code 130", i)));
    // Each node stopped after a whole step and checkpointed exactly there.
    const auto metrics = read_jsonl(node + "/metrics.jsonl");
    ASSERT_FALSE(metrics.empty());
    const auto state = nlohmann::json::parse(file_read(node + "/checkpoint/state.json"));
    EXPECT_EQ(state["step"], metrics.back()["step"]) << "node " << i;
  }
}

// The per-step losses of a run directory's metrics.jsonl (a step logged again after a restart
// counts once, its last line).
std::map<int64_t, double> losses_by_step(const std::string& run_dir) {
  std::map<int64_t, double> out;
  for (const auto& l : read_jsonl(run_dir + "/metrics.jsonl"))
    if (l.contains("loss")) out[l["step"].get<int64_t>()] = l["loss"].get<double>();
  return out;
}

std::map<int64_t, std::string> published_digests(const std::string& server_dir) {
  std::map<int64_t, std::string> out;
  for (const auto& r : read_jsonl(server_dir + "/rounds.jsonl"))
    out[r["round"].get<int64_t>()] = r["model_sha256"].get<std::string>();
  return out;
}

// `spes launch` of 2 nodes on DIR, stopped with Ctrl-C once node 0 has `steps` steps, then
// continued with --resume; returns false (with the output) when a stage did not do its part.
::testing::AssertionResult stop_and_continue(const std::vector<std::string>& launch_args,
                                             size_t steps) {
  std::vector<std::string> lines;
  Subprocess first(launch_args);
  const std::string dir = launch_args[std::find(launch_args.begin(), launch_args.end(), "--out") -
                                      launch_args.begin() + 1];
  if (!wait_for_steps(first, dir + "/node0", steps, &lines))
    return ::testing::AssertionFailure() << "the run ended before the stop:\n" << joined(lines);
  first.kill(SIGINT);
  if (const int code = finish_child(first, &lines); code != 130)
    return ::testing::AssertionFailure() << "stopped launch exited " << code << ":\n"
                                         << joined(lines);
  if (joined(lines).find("--resume") == std::string::npos)
    return ::testing::AssertionFailure() << "no hint to continue:\n" << joined(lines);
  std::vector<std::string> args = launch_args;
  args.push_back("--resume");
  Subprocess second(args);
  if (const int code = finish_child(second, &lines); code != 0)
    return ::testing::AssertionFailure() << "continued launch exited " << code << ":\n"
                                         << joined(lines);
  return ::testing::AssertionSuccess();
}

// The deterministic configuration (CPU, no overlap, one thread per node) with `settings`:
// a 2-node launch of 100 steps stopped with Ctrl-C after 25 steps of node 0 and continued
// publishes the same models, logs the same losses and ends on the same weights as one that
// ran without a stop.
void expect_stopped_run_equals_uninterrupted(const std::string& name,
                                             const std::vector<std::string>& settings) {
  const auto args = [&](const std::string& out) {
    std::vector<std::string> a{SPES_BINARY, "launch", "--config", g_dir + "/config.yaml",
                               "--nodes", "2", "--out", out, "--no-summary", "--set",
                               "max_duration=100"};
    for (const auto& s : settings) a.insert(a.end(), {"--set", s});
    return a;
  };
  const std::string once = g_dir + "/" + name + "_once", twice = g_dir + "/" + name + "_twice";
  std::string out;
  ASSERT_EQ(run_child(args(once), &out, 300), 0) << out;
  ASSERT_TRUE(stop_and_continue(args(twice), 25));
  const auto digests = published_digests(once + "/server");
  ASSERT_EQ(digests.size(), 10u);
  EXPECT_EQ(published_digests(twice + "/server"), digests);
  for (int i = 0; i < 2; ++i) {
    const std::string a = once + "/node" + std::to_string(i);
    const std::string b = twice + "/node" + std::to_string(i);
    const auto la = losses_by_step(a), lb = losses_by_step(b);
    EXPECT_EQ(la.size(), 100u);
    EXPECT_EQ(lb, la) << "node " << i;
    EXPECT_EQ(file_read(b + "/checkpoint/model.safetensors"),
              file_read(a + "/checkpoint/model.safetensors")) << "node " << i;
  }
}

TEST_F(SyncEndToEnd, LaunchStoppedAndContinuedEqualsAnUninterruptedRun) {
  expect_stopped_run_equals_uninterrupted("launch", {});  // fp32 sync
}

// With top-k sparse deltas the node's checkpoint keeps its base and error-feedback
// accumulator (sync.safetensors): the continued run is the uninterrupted one bit for bit
// (nodes that train on the published model alone; the default, with what was not sent in the
// weights, below).
TEST_F(SyncEndToEnd, TopkLaunchStoppedAndContinuedEqualsAnUninterruptedRun) {
  expect_stopped_run_equals_uninterrupted(
      "launch_topk", {"spes_config.compression=topk", "spes_config.topk_density=0.05",
                      "spes_config.topk_unsent_in_weights=false"});
  const auto state =
      nlohmann::json::parse(file_read(g_dir + "/launch_topk_twice/node0/checkpoint/state.json"));
  EXPECT_EQ(state["extra"]["sync"]["compression"], "topk") << state.dump(1);
  EXPECT_EQ(state["extra"]["sync"]["round"], 10) << state.dump(1);
  EXPECT_TRUE(state["files"].contains("sync.safetensors")) << state.dump(1);
}

// With topk_unsent_in_weights the nodes train on the published model plus what they have not
// sent (their weights differ between rounds): a stopped and continued run is still the
// uninterrupted one bit for bit, and after the last round every node holds the published model.
TEST_F(SyncEndToEnd, TopkUnsentInWeightsLaunchStoppedAndContinuedEqualsAnUninterruptedRun) {
  expect_stopped_run_equals_uninterrupted(
      "launch_topk_unsent", {"spes_config.compression=topk", "spes_config.topk_density=0.05",
                             "spes_config.topk_unsent_in_weights=true"});
  for (const char* run : {"launch_topk_unsent_once", "launch_topk_unsent_twice"}) {
    const std::string dir = g_dir + "/" + run;
    EXPECT_EQ(file_read(dir + "/node1/checkpoint/model.safetensors"),
              file_read(dir + "/node0/checkpoint/model.safetensors")) << run;
  }
  // Overlap (the published model applied 3 steps after the upload, plus the steps since).
  const std::string dir = g_dir + "/launch_topk_unsent_overlap";
  std::string out;
  ASSERT_EQ(run_child({SPES_BINARY, "launch", "--config", g_dir + "/config.yaml", "--nodes", "2",
                       "--out", dir, "--set", "max_duration=100", "--set",
                       "spes_config.compression=topk", "--set", "spes_config.topk_density=0.05",
                       "--set", "spes_config.topk_unsent_in_weights=true", "--set",
                       "spes_config.overlap=true", "--set", "spes_config.overlap_delay_steps=3"},
                      &out, 300), 0) << out;
  const auto summary = nlohmann::json::parse(file_read(dir + "/summary.json"));
  EXPECT_TRUE(summary["all_nodes_same_model_after_every_sync"].get<bool>()) << summary.dump(1);
  EXPECT_EQ(published_digests(dir + "/server").size(), 10u);
  EXPECT_EQ(file_read(dir + "/node1/checkpoint/model.safetensors"),
            file_read(dir + "/node0/checkpoint/model.safetensors"));
}

TEST_F(SyncEndToEnd, CompressedLaunchStoppedAndContinuedKeepsEveryNodeOnThePublishedModel) {
  const std::string dir = g_dir + "/launch_int8_twice";
  ASSERT_TRUE(stop_and_continue({SPES_BINARY, "launch", "--config", g_dir + "/config.yaml",
                                 "--nodes", "2", "--out", dir, "--no-summary", "--set",
                                 "max_duration=60", "--set",
                                 "spes_config.compression=int8"}, 25));
  const auto summary = nlohmann::json::parse(file_read(dir + "/summary.json"));
  EXPECT_TRUE(summary["all_nodes_same_model_after_every_sync"].get<bool>()) << summary.dump(1);
  EXPECT_EQ(published_digests(dir + "/server").size(), 6u);
}

TEST_F(SyncEndToEnd, ALaunchOnAnEarlierRunAsksForResumeOrOverwriteAndNeverDeletesALiveOne) {
  const std::string dir = g_dir + "/launch_locked";
  const std::vector<std::string> base = {SPES_BINARY, "launch", "--config",
                                         g_dir + "/config.yaml", "--nodes", "2", "--out", dir,
                                         "--no-summary", "--set", "max_duration=100000"};
  Subprocess live(base);
  std::vector<std::string> lines;
  ASSERT_TRUE(wait_for_steps(live, dir + "/node0", 3, &lines)) << joined(lines);
  // --overwrite on the live run: refused, naming the launcher that holds DIR.
  std::vector<std::string> overwrite = base;
  overwrite.push_back("--overwrite");
  std::string out;
  EXPECT_EQ(run_child(overwrite, &out), 1) << out;
  EXPECT_THAT(out, ::testing::HasSubstr(fmt::format("'{}' is being written by process {} ({} launch",
                                                    dir, live.pid(), SPES_BINARY)));
  const size_t steps = whole_lines(dir + "/node0/metrics.jsonl");
  ASSERT_TRUE(wait_for_steps(live, dir + "/node0", steps + 2, &lines)) << joined(lines);
  live.kill(SIGINT);
  ASSERT_EQ(finish_child(live, &lines), 130) << joined(lines);

  // Stopped: a plain launch on it asks for --resume or --overwrite and changes nothing.
  const std::string before = file_read(dir + "/node0/metrics.jsonl");
  out.clear();
  EXPECT_EQ(run_child(base, &out), 1) << out;
  EXPECT_THAT(out, ::testing::HasSubstr("holds an earlier run (server/, node0/): pass --resume "
                                        "to continue it, or --overwrite"));
  std::vector<std::string> both = base;
  both.insert(both.end(), {"--resume", "--overwrite"});
  out.clear();
  EXPECT_EQ(run_child(both, &out), 1) << out;
  EXPECT_THAT(out, ::testing::HasSubstr("--resume and --overwrite exclude each other"));
  EXPECT_EQ(file_read(dir + "/node0/metrics.jsonl"), before);
  EXPECT_TRUE(fs::exists(dir + "/node0/checkpoint/state.json"));
}

}  // namespace
