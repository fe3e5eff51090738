// The server's store of handed-over moments (handed_moments.h).
#include "spes/sync/server/handed_moments.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <set>

#include "spes/common/strings.h"
#include "spes/io/files.h"
#include "spes/model/transformer.h"
#include "spes/sync/round/moments_handoff.h"
#include "spes/sync/wire/protocol.h"

namespace fs = std::filesystem;

namespace spes::sync {

MomentsIntake::MomentsIntake(std::string path, uint64_t total_bytes, uint64_t max_bytes,
                             int64_t node)
    : path_(std::move(path)), total_(total_bytes), node_(node) {
  if (total_bytes > max_bytes)
    sync_fail(SyncErrc::ResourceExhausted, "moments handover of node {}: {} bytes declared, but "
              "the experts it owns need at most {}", node, total_bytes, max_bytes);
  f_ = std::fopen(path_.c_str(), "wb");
  if (!f_) fail("cannot create '{}' for node {}'s moments", path_, node);
}

MomentsIntake::~MomentsIntake() {
  if (f_) std::fclose(f_);
  if (!path_.empty()) {
    std::error_code ec;
    fs::remove(path_, ec);
  }
}

void MomentsIntake::chunk(uint64_t offset, const std::string& data,
                          const std::string& checksum) {
  if (offset != received_)
    sync_fail(SyncErrc::InvalidArgument, "moments handover of node {}: a chunk at byte {} after "
              "{} bytes (chunks must follow each other; send the stream again)", node_, offset,
              received_);
  if (data.size() > kMaxChunkBytes || received_ + data.size() > total_)
    sync_fail(SyncErrc::ResourceExhausted, "moments handover of node {}: a chunk of {} bytes at "
              "byte {} goes past the chunk limit {} or the declared size {}", node_, data.size(),
              offset, kMaxChunkBytes, total_);
  if (chunk_checksum(data) != checksum)
    sync_fail(SyncErrc::DataLoss, "moments handover of node {}: the chunk at byte {} does not "
              "match its checksum", node_, offset);
  if (std::fwrite(data.data(), 1, data.size(), f_) != data.size())
    fail("cannot write '{}' (disk full?)", path_);
  whole_.update(data.data(), data.size());
  received_ += data.size();
}

void MomentsIntake::finish(const std::string& expected) {
  if (received_ != total_)
    sync_fail(SyncErrc::DataLoss, "moments handover of node {}: the stream ended after {} of {} "
              "bytes", node_, received_, total_);
  if (expected.empty() || whole_.hex_digest() != expected)
    sync_fail(SyncErrc::DataLoss, "moments handover of node {}: the whole stream's checksum {} "
              "(required in the last chunk)", node_, expected.empty() ? "is missing" : "differs");
  if (std::fflush(f_) != 0 || ::fsync(fileno(f_)) != 0 || std::fclose(f_) != 0) {
    f_ = nullptr;
    fail("cannot write '{}' (disk full?)", path_);
  }
  f_ = nullptr;
}

HandedMoments::HandedMoments(std::string dir) : dir_(std::move(dir)) {}

std::string HandedMoments::path(int64_t node, int64_t epoch) const {
  return fmt::format("{}/moments-node{}-epoch{}.safetensors", dir(), node, epoch);
}

std::string HandedMoments::staging_path(int64_t node) {
  fs::create_directories(dir());
  return fmt::format("{}/moments-node{}.tmp.{}.{}", dir(), node, ::getpid(), ++next_);
}

std::vector<std::pair<int64_t, int64_t>> HandedMoments::check(const std::string& staged,
                                                              const RoundPlan& plan,
                                                              int64_t node,
                                                              const Ownership* previous,
                                                              bool* lost) const {
  const std::string origin = fmt::format("moments handover of node {}", node);
  Metadata md;
  NamedTensors ts;
  try {
    ts = safetensors_load(staged, &md);
  } catch (const std::exception& e) {
    sync_fail(SyncErrc::InvalidArgument, "{}: not a safetensors stream: {}", origin,
              printable(e.what()));
  }
  auto experts = check_moments_handoff(plan, ts, md, node, origin, previous);
  if (lost) *lost = moments_lost(md);
  return experts;
}

void HandedMoments::keep(MomentsIntake& staged, int64_t node, int64_t epoch) {
  fs::rename(staged.path(), path(node, epoch));
  staged.release();
  dir_fsync(dir());
}

NamedTensors HandedMoments::for_node(int64_t node, int64_t epoch,
                                     const nlohmann::json& handoffs) const {
  // Per previous owner: the names of the tensors handed to `node`.
  std::map<int64_t, std::set<std::string>> wanted;
  for (const auto& h : handoffs) {
    if (h.at("to").get<int64_t>() != node) continue;
    for (const char* proj : {"gate_proj", "up_proj", "down_proj"})
      wanted[h.at("from").get<int64_t>()].insert(expert_param_name(
          h.at("layer").get<int64_t>(), h.at("expert").get<int64_t>(), proj));
  }
  std::map<std::string, torch::Tensor> out;
  for (auto& [from, names] : wanted) {
    // The owner's handovers, newest epoch first, below `epoch`.
    for (int64_t e = epoch - 1; e >= 0 && !names.empty(); --e) {
      const std::string p = path(from, e);
      if (!file_exists(p)) continue;
      const ExpertMoments m = moments_from_tensors(safetensors_load(p), p);
      for (auto it = names.begin(); it != names.end();) {
        auto got = m.by_name.find(*it);
        if (got == m.by_name.end()) {
          ++it;
          continue;
        }
        ExpertMoments one;
        one.by_name[*it] = got->second;
        for (auto& [k, t] : moments_tensors(one)) out[k] = t;
        it = names.erase(it);
      }
    }
  }
  return {out.begin(), out.end()};
}

void HandedMoments::remove_all() {
  std::error_code ec;
  const auto n = fs::remove_all(dir(), ec);
  if (ec) spdlog::warn("cannot remove the handed-over moments in '{}': {}", dir(), ec.message());
  else if (n > 0) spdlog::info("the run ended: removed the handed-over moments in '{}'", dir());
}

}  // namespace spes::sync
