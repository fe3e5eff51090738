// Cluster run report and offline verification (see run_report.h).
#include "spes/cluster/run_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/interop/init_checkpoint.h"
#include "spes/io/files.h"
#include "spes/io/run_layout.h"
#include "spes/io/safetensors.h"
#include "spes/io/sync_record.h"
#include "spes/model/ownership.h"
#include "spes/sync/round/aggregate.h"
#include "spes/sync/round/ownership_map.h"
#include "spes/sync/round/round_clock.h"

namespace spes {
namespace fs = std::filesystem;

namespace {
double mean(const std::vector<double>& v) {
  if (v.empty()) return 0;
  double s = 0;
  for (double x : v) s += x;
  return s / static_cast<double>(v.size());
}
}  // namespace

namespace {
// What the nodes reported: round -> node -> the digest it held after loading that round, the
// digests the initial nodes started from (their first joins), and the round an arriving node
// first joined at (the published round it took).
struct NodeDigests {
  std::map<int64_t, std::map<int64_t, std::string>> by_round;
  std::set<std::string> at_join;
  int64_t arrival_joined_at = -1;
};

// The server's figures from rounds.jsonl; `published` gets each round's digest.
nlohmann::json server_figures(const std::vector<nlohmann::json>& rounds,
                              std::map<int64_t, std::string>* published) {
  std::vector<double> round_s, download_s, bytes_in, bytes_out;
  double server_rss = 0;
  for (const auto& r : rounds) {
    (*published)[r.at("round").get<int64_t>()] = r.at("model_sha256").get<std::string>();
    round_s.push_back(r.value("seconds", 0.0));
    download_s.push_back(r.value("download_s", 0.0));
    bytes_in.push_back(r.value("bytes_in", 0.0));
    bytes_out.push_back(r.value("bytes_out", 0.0));
    server_rss = std::max(server_rss, r.value("peak_rss_mb", 0.0));
  }
  return {{"rounds", rounds.size()},
          {"round_seconds_mean", mean(round_s)},
          {"round_seconds_max",
           round_s.empty() ? 0.0 : *std::max_element(round_s.begin(), round_s.end())},
          {"download_seconds_mean", mean(download_s)},
          {"bytes_in_per_round", mean(bytes_in)},
          {"bytes_out_per_round", mean(bytes_out)},
          {"peak_rss_mb", server_rss}};
}

// Node i's figures from its metrics.jsonl; `digests` gets what it reported.
nlohmann::json node_figures(const std::string& dir, int64_t i, const NodeDisruption& stopped,
                            const NodeArrival& arrival, NodeDigests* digests) {
  const bool arrives = arrival.active() && arrival.node == i;
  const auto lines = read_jsonl(run_layout::metrics(run_layout::cluster_node(dir, i)));
  nlohmann::json n = {{"node", i}};
  double rss = 0;
  std::vector<double> up, down, sync_s;
  for (const auto& l : lines) {
    if (l.contains("val_loss")) n["final_val_loss"] = l["val_loss"];
    if (l.contains("step")) n["steps"] = l["step"];
    rss = std::max(rss, l.value("peak_rss_mb", 0.0));
    // The first join is the run's start (every initial node on one model; an arrival on the
    // round it took); a node continued after a stop joins again from its own checkpoint, and
    // may first finish the round it stopped in.
    if (l.contains("sync_join") && !n.contains("join")) {
      if (arrives)
        digests->arrival_joined_at = l["sync_join"].value("round", int64_t{0});
      else
        digests->at_join.insert(l["sync_join"].value("model_sha256", ""));
      n["join"] = l["sync_join"];
    }
    std::vector<const nlohmann::json*> syncs;
    if (l.contains("sync_join") && l["sync_join"].contains("pending_round"))
      syncs.push_back(&l["sync_join"]["pending_round"]);
    if (l.contains("sync")) syncs.push_back(&l["sync"]);
    for (const nlohmann::json* sp : syncs) {
      const auto& s = *sp;
      digests->by_round[s.at("round").get<int64_t>()][i] = s.value("model_sha256", "");
      up.push_back(sync_record_bytes_up(s));
      down.push_back(sync_record_bytes_down(s));
      sync_s.push_back(s.value("blocked_s", s.value("seconds", 0.0)));
    }
  }
  n["peak_rss_mb"] = rss;
  n["syncs"] = up.size();
  n["bytes_up_per_round"] = mean(up);
  n["bytes_down_per_round"] = mean(down);
  n["sync_seconds_mean"] = mean(sync_s);
  if (stopped.active() && stopped.node == i)
    n["disrupted"] = {{"what", stopped.describe()}, {"after_round", stopped.at_round}};
  if (arrives)
    n["arrived"] = {{"what", arrival.describe()}, {"after_round", arrival.after_round},
                    {"joined_at_round", digests->arrival_joined_at}};
  return n;
}

// Per published round, whether every node in the run then reported exactly its digest (the
// disrupted node: the rounds before the one it was stopped after; that one if it got to it;
// the arrival: every round after the one it joined at, and none before).
// `consistent`: every round agreed, no node synced a round never logged, the initial nodes
// joined one model, the arrival joined.
nlohmann::json round_agreement(const std::map<int64_t, std::string>& published,
                               NodeDigests& digests, int64_t nodes,
                               const NodeDisruption& stopped, const NodeArrival& arrival,
                               bool* consistent) {
  *consistent = !published.empty() && digests.at_join.size() == 1 &&
                (!arrival.active() || digests.arrival_joined_at >= 0);
  nlohmann::json per_round = nlohmann::json::array();
  for (const auto& [round, sha] : published) {
    std::map<int64_t, std::string>& reported = digests.by_round[round];
    int64_t expected = nodes;
    if (stopped.active() && round >= stopped.at_round && !reported.count(stopped.node))
      --expected;
    if (arrival.active() && (digests.arrival_joined_at < 0 || round <= digests.arrival_joined_at))
      --expected;  // not in the run yet
    bool ok = static_cast<int64_t>(reported.size()) == expected;
    for (const auto& [node, s] : reported) ok = ok && s == sha;
    per_round.push_back({{"round", round}, {"model_sha256", sha}, {"nodes_agree", ok}});
    *consistent = *consistent && ok;
  }
  for (const auto& [round, m] : digests.by_round)
    if (!published.count(round)) *consistent = false;  // a node synced a round never logged
  return per_round;
}
}  // namespace

nlohmann::json cluster_report(const std::string& dir, int64_t nodes,
                              const NodeDisruption& stopped, const NodeArrival& arrival) {
  nlohmann::json rep;
  std::map<int64_t, std::string> published;
  rep["server"] = server_figures(
      read_jsonl(run_layout::rounds_log(run_layout::cluster_server(dir))), &published);
  NodeDigests digests;
  rep["nodes"] = nlohmann::json::array();
  for (int64_t i = 0; i < nodes; ++i)
    rep["nodes"].push_back(node_figures(dir, i, stopped, arrival, &digests));
  bool consistent = false;
  rep["rounds"] = round_agreement(published, digests, nodes, stopped, arrival, &consistent);
  rep["join_same_model"] = digests.at_join.size() == 1;
  rep["all_nodes_same_model_after_every_sync"] = consistent;
  return rep;
}

std::string format_cluster_report(const nlohmann::json& rep) {
  std::string s;
  const auto& srv = rep["server"];
  s += fmt::format("rounds: {} | round latency at the server {:.2f} s mean, {:.2f} s max "
                   "(first upload -> published) | downloads {:.2f} s | server peak RSS {:.0f} "
                   "MiB\n", srv["rounds"].get<int64_t>(), srv["round_seconds_mean"].get<double>(),
                   srv["round_seconds_max"].get<double>(),
                   srv["download_seconds_mean"].get<double>(), srv["peak_rss_mb"].get<double>());
  s += fmt::format("{:>6} {:>10} {:>7} {:>12} {:>12} {:>10} {:>9}\n", "node", "val_loss", "syncs",
                   "up/round", "down/round", "sync_s", "peak_RSS");
  for (const auto& n : rep["nodes"]) {
    const std::string loss = n.contains("final_val_loss")
                                 ? fmt::format("{:.4f}", n["final_val_loss"].get<double>())
                                 : std::string("-");
    s += fmt::format("{:>6} {:>10} {:>7} {:>12} {:>12} {:>10.2f} {:>6.0f} MiB\n",
                     n["node"].get<int64_t>(), loss, n["syncs"].get<int64_t>(),
                     human_bytes(n["bytes_up_per_round"].get<double>()),
                     human_bytes(n["bytes_down_per_round"].get<double>()),
                     n["sync_seconds_mean"].get<double>(), n["peak_rss_mb"].get<double>());
  }
  s += fmt::format("initial model identical on every node: {} | every node held the published "
                   "model after every sync: {}\n",
                   rep["join_same_model"].get<bool>() ? "yes" : "NO",
                   rep["all_nodes_same_model_after_every_sync"].get<bool>() ? "yes" : "NO");
  if (rep.contains("verify")) {
    const auto& v = rep["verify"];
    s += fmt::format("published model == `spes aggregate` of the kept uploads: {}/{} rounds\n",
                     v["equal"].get<int64_t>(), v["checked"].get<int64_t>());
  }
  return s;
}

nlohmann::json verify_kept_rounds(const Config& cfg, const std::string& server_dir) {
  nlohmann::json out = {{"checked", 0}, {"equal", 0}, {"mismatched", nlohmann::json::array()}};
  sync::SyncModel model(cfg, init_checkpoint_weights(cfg.model));
  const bool outer = cfg.spes_config.uses_outer_step();
  const sync::RoundClock clock(cfg);
  // After a handoff each round is replayed under its ownership epoch's map.
  const std::string epochs_file = run_layout::ownership_epochs(server_dir);
  const bool has_epochs = fs::exists(epochs_file);
  int64_t epoch = 0;
  for (int64_t r = 1;; ++r) {
    const std::string rdir = run_layout::kept_round(server_dir, r);
    const std::string published = run_layout::kept_published(server_dir, r);
    if (!fs::exists(published)) break;
    std::vector<std::string> uploads;
    for (const auto& e : fs::directory_iterator(rdir)) {
      const std::string name = e.path().filename().string();
      if (starts_with(name, "node") && ends_with(name, ".safetensors"))
        uploads.push_back(e.path().string());
    }
    const std::string prev = run_layout::kept_published(server_dir, r - 1);
    if (fs::exists(prev)) model.load(safetensors_load(prev), prev);
    if (outer) {
      for (auto& m : model.momentum()) m = torch::Tensor();
      const std::string mom = run_layout::kept_momentum(server_dir, r - 1);
      if (fs::exists(mom)) model.load_momentum(safetensors_load(mom), mom);
    }
    if (has_epochs) {
      const auto [m, owners] =
          sync::round_ownership_from_file(epochs_file, Ownership::from_config(cfg), r);
      if (m.epoch != epoch) model.change_ownership(owners, m.epoch);
      epoch = m.epoch;
    }
    const sync::RoundOutcome o = sync::aggregate_offline(model, uploads, clock.step_of(r));
    const bool same = sync::stream_equals_file(
        sync::published_writer(model, o.round, o.step, model.weights_sha256()), published);
    out["checked"] = out["checked"].get<int64_t>() + 1;
    if (same) {
      out["equal"] = out["equal"].get<int64_t>() + 1;
    } else {
      out["mismatched"].push_back(r);
    }
  }
  return out;
}

}  // namespace spes
