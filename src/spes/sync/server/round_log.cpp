// rounds.jsonl and the recent round history (see round_log.h).
#include "spes/sync/server/round_log.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <fstream>

#include "spes/common/error.h"
#include "spes/common/sysinfo.h"
#include "spes/common/timing.h"
#include "spes/io/run_layout.h"

namespace spes::sync {

namespace {
using Clock = std::chrono::steady_clock;

bool all_true(const std::vector<bool>& v) {
  return std::all_of(v.begin(), v.end(), [](bool b) { return b; });
}

// The figures of a rounds.jsonl line that go to TensorBoard, and their tags.
const std::vector<ScalarKey> kRoundScalars = {
    {"round", "round/number"},       {"seconds", "round/seconds"},
    {"bytes_in", "round/bytes_in"},  {"bytes_out", "round/bytes_out"},
    {"aggregate_s", "round/aggregate_s"}, {"persist_s", "round/persist_s"},
    {"publish_s", "round/publish_s"}, {"download_s", "round/download_s"},
    {"alpha", "round/alpha"},        {"peak_rss_mb", "round/peak_rss_mb"},
    {"nodes_used", "round/nodes"}};
}  // namespace

RoundLog::RoundLog(const std::string& dir, bool resumed, int64_t published_round,
                   const nlohmann::json& saved_line)
    : tensorboard_(dir) {
  const std::string path = run_layout::rounds_log(dir);
  file_ = std::fopen(path.c_str(), resumed ? "a" : "w");
  SPES_CHECK(file_, "cannot open '{}/rounds.jsonl' for writing", dir);
  if (!resumed) return;
  // A round published just before a crash may lack its rounds.jsonl line (lines are written
  // when every node has downloaded): write it from state.json, marked recovered.
  int64_t last_line = 0;
  {
    std::ifstream in(path);
    std::string text;
    while (std::getline(in, text)) {
      const auto l = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
      if (!l.is_object()) continue;
      last_line = std::max<int64_t>(last_line, l.value("round", int64_t{0}));
      remember(l);
    }
  }
  if (last_line < published_round && saved_line.is_object()) {
    nlohmann::json line = saved_line;
    line["recovered"] = true;
    line["downloads_complete"] = false;
    remember(line);
    append(line);
  }
}

RoundLog::~RoundLog() {
  if (file_) std::fclose(file_);
}

void RoundLog::published(nlohmann::json line, const std::vector<int64_t>& used,
                         size_t num_nodes, Clock::time_point published_at) {
  Pending p;
  p.round = line.value("round", int64_t{0});
  p.line = std::move(line);
  p.published_at = published_at;
  p.bytes_out.assign(num_nodes, 0);
  p.bytes_out_wire.assign(num_nodes, 0);
  // The line waits for the downloads of the nodes whose uploads the round used (a missing
  // node takes the whole model instead, if it ever comes back).
  p.downloaded.assign(num_nodes, true);
  for (int64_t n : used) p.downloaded[n] = false;
  remember(p.line);
  // Lines stay in round order: an older round still waiting for downloads is written now.
  flush_pending();
  pending_.push_back(std::move(p));
}

void RoundLog::downloaded(int64_t node, int64_t round, uint64_t bytes, uint64_t wire_bytes) {
  for (size_t k = 0; k < pending_.size(); ++k) {
    Pending& p = pending_[k];
    if (p.round != round) continue;
    p.bytes_out[node] += bytes;
    p.bytes_out_wire[node] += wire_bytes;
    p.downloaded[node] = true;
    if (all_true(p.downloaded)) {
      write(p);
      pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(k));
    }
    return;
  }
}

void RoundLog::flush_pending() {
  for (auto& p : pending_) write(p);
  pending_.clear();
}

void RoundLog::write(Pending& p) {
  uint64_t total = 0;
  for (uint64_t b : p.bytes_out) total += b;
  p.line["bytes_out"] = total;
  p.line["bytes_out_per_node"] = p.bytes_out;
  p.line["bytes_out_wire_per_node"] = p.bytes_out_wire;
  p.line["download_s"] = seconds_since(p.published_at);
  p.line["downloads_complete"] = all_true(p.downloaded);
  p.line["peak_rss_mb"] = peak_rss_mb();
  p.line["time"] = unix_time();
  remember(p.line);  // now with its download figures
  append(p.line);
}

void RoundLog::append(const nlohmann::json& line) {
  // Text from nodes is made printable before it gets here; `replace` keeps any byte that is
  // still not UTF-8 from stopping the log.
  const std::string s =
      line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  if (std::fwrite(s.data(), 1, s.size(), file_) != s.size() || std::fflush(file_) != 0)
    spdlog::error("cannot append round {} to rounds.jsonl (disk full?); the round is published "
                  "and saved in state.json", line.value("round", int64_t{-1}));
  nlohmann::json figures = line;
  if (line.contains("nodes") && line["nodes"].is_array()) figures["nodes_used"] = line["nodes"].size();
  tensorboard_.write(line.value("step", int64_t{0}), line.value("time", unix_time()), figures,
                     kRoundScalars);
}

void RoundLog::remember(const nlohmann::json& line) {
  const int64_t round = line.value("round", int64_t{-1});
  // Replaces the record of the same round (its line now has the download figures).
  for (auto it = history_.rbegin(); it != history_.rend(); ++it)
    if (it->value("round", int64_t{-1}) == round) {
      *it = line;
      return;
    }
  history_.push_back(line);
  while (history_.size() > kHistory) history_.pop_front();
}

}  // namespace spes::sync
