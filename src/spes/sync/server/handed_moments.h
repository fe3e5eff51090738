// Where the sync server keeps the AdamW moments that departing nodes handed over (protocol 9,
// docs/PROTOCOL.md "Handing over the moments"): a HandOver stream is received into a staging
// file (chunks contiguous, each checksummed, the whole stream's checksum required, its size
// bounded by what the node's experts can need), checked against the collecting round's plan
// (round/moments_handoff.h) and renamed into DIR/handoff/moments-node<N>-epoch<E>.safetensors,
// E the epoch the node owned them under. A file survives a server restart; a node gaining
// experts in epoch F gets, for each expert handed to it, the moments from the file of the
// expert's previous owner with the highest epoch below F that holds it. Every file is removed
// when the run ends (every node has left). Not thread-safe where noted; the owner
// (RoundState) serialises the renames under its lock. Leaves out: when a handover is
// admissible (round_state.cpp) and the transport (rpc_calls.cpp).
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "spes/io/safetensors.h"
#include "spes/sync/round/plan.h"
#include "spes/sync/wire/checksum.h"

namespace spes::sync {

// One HandOver stream into its staging file (deleted unless kept).
class MomentsIntake {
 public:
  MomentsIntake(std::string path, uint64_t total_bytes, uint64_t max_bytes, int64_t node);
  ~MomentsIntake();
  MomentsIntake(const MomentsIntake&) = delete;
  MomentsIntake& operator=(const MomentsIntake&) = delete;
  // Throws SyncError: a chunk not at the end of the bytes so far (InvalidArgument), larger than
  // kMaxChunkBytes or past total_bytes (ResourceExhausted), a wrong checksum (DataLoss).
  void chunk(uint64_t offset, const std::string& data, const std::string& checksum);
  // The stream is complete and its checksum is `expected` (DataLoss otherwise); flushed.
  void finish(const std::string& expected);
  const std::string& path() const { return path_; }
  uint64_t bytes() const { return received_; }
  void release() { path_.clear(); }  // the file was moved: not deleted here

 private:
  std::string path_;
  uint64_t total_, received_ = 0;
  int64_t node_;
  std::FILE* f_ = nullptr;
  StreamChecksum whole_;
};

class HandedMoments {
 public:
  explicit HandedMoments(std::string dir);  // DIR (the server's --out)
  std::string dir() const { return dir_ + "/handoff"; }
  std::string path(int64_t node, int64_t epoch) const;
  // A fresh staging path for `node`'s stream (the directory is created).
  std::string staging_path(int64_t node);
  // Loads and checks a staged handover against `plan` (check_moments_handoff). Returns the
  // experts it holds; throws SyncError (the staged file stays for its intake to remove).
  // `previous`: the map of the epoch before the plan's (a "lost" handover's check), or null.
  // `lost` (when given) says whether the handover was of the "lost" kind.
  std::vector<std::pair<int64_t, int64_t>> check(const std::string& staged, const RoundPlan& plan,
                                                 int64_t node, const Ownership* previous = nullptr,
                                                 bool* lost = nullptr) const;
  // Moves a checked handover into place (replacing an earlier one of the same node and epoch).
  void keep(MomentsIntake& staged, int64_t node, int64_t epoch);
  // The moments handed to `node` by epoch `epoch`'s handoffs ([{layer, expert, from, to}]):
  // the stream tensors of round/moments_handoff.h, name order; experts whose previous owner
  // handed nothing over are absent.
  NamedTensors for_node(int64_t node, int64_t epoch, const nlohmann::json& handoffs) const;
  // Every kept file and staging file (the run ended).
  void remove_all();

 private:
  std::string dir_;
  uint64_t next_ = 0;
};

}  // namespace spes::sync
