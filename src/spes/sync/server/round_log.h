// DIR/rounds.jsonl, one line per published round, and the latest lines for the dashboard. A
// round's line is written once every node whose upload the round used has downloaded it (with
// the bytes each took and how long the downloads ran), when a newer round publishes first
// (lines stay in round order), or at close; history() has it from publication on. After a
// restart the file is appended to, its lines come back into the history, and the line of the
// last published round is written from state.json if the crash lost it (marked recovered).
// Each line's figures also go to DIR's TensorBoard event file (io/tensorboard_writer.h).
// Not thread-safe: RoundState's lock guards it. Leaves out: what a line says (RoundState).
#pragma once
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "spes/io/tensorboard_writer.h"

namespace spes::sync {

class RoundLog {
 public:
  static constexpr size_t kHistory = 1000;
  // `resumed`: continue DIR's file; `published_round` and `saved_line` (state.json's copy of its
  // line, null if none) recover the last round's line.
  RoundLog(const std::string& dir, bool resumed, int64_t published_round,
           const nlohmann::json& saved_line);
  ~RoundLog();
  RoundLog(const RoundLog&) = delete;
  RoundLog& operator=(const RoundLog&) = delete;

  // A round was published at `published_at` with `line`; its line waits for the downloads of
  // `used` (of `num_nodes` nodes).
  void published(nlohmann::json line, const std::vector<int64_t>& used, size_t num_nodes,
                 std::chrono::steady_clock::time_point published_at);
  // Node `node` downloaded `bytes` of round `round` (the part for its node), `wire_bytes` of
  // them as they crossed the wire (coded chunks, wire/chunk_coding.h).
  void downloaded(int64_t node, int64_t round, uint64_t bytes, uint64_t wire_bytes);
  // Writes the lines still waiting for downloads.
  void flush_pending();
  // The latest lines (at most kHistory, oldest first).
  std::vector<nlohmann::json> history() const { return {history_.begin(), history_.end()}; }

 private:
  struct Pending {
    int64_t round = 0;
    nlohmann::json line;
    std::vector<uint64_t> bytes_out, bytes_out_wire;
    std::vector<bool> downloaded;
    std::chrono::steady_clock::time_point published_at;
  };
  void write(Pending& p);
  void append(const nlohmann::json& line);
  void remember(const nlohmann::json& line);
  std::FILE* file_ = nullptr;
  TensorBoardWriter tensorboard_;  // each line's figures, at the round's training step
  std::vector<Pending> pending_;
  std::deque<nlohmann::json> history_;
};

}  // namespace spes::sync
