// Test fault injection for nodes (see node_faults.h).
#include "fault_node/node_faults.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <thread>

#include "spes/common/error.h"
#include "spes/sync/wire/checksum.h"

namespace spes::sync {

bool NodeFaults::any() const {
  return nan_round >= 0 || foreign_round >= 0 || scaled_round >= 0 || corrupt_round >= 0 ||
         badname_round >= 0 || poison_round >= 0 || grow_round >= 0 ||
         stall_round >= 0 || replay_round >= 0 || cut_round >= 0 || dup_round >= 0;
}

NodeFaults parse_node_faults(const std::string& spec) {
  NodeFaults f;
  std::stringstream ss(spec);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    const size_t at = item.find('@');
    SPES_CHECK(at != std::string::npos, "SPES_SYNC_FAULTS: '{}' is not KIND@ROUND", item);
    const std::string kind = item.substr(0, at);
    std::string rest = item.substr(at + 1);
    double seconds = 0;
    if (kind == "stall") {
      const size_t colon = rest.find(':');
      SPES_CHECK(colon != std::string::npos, "SPES_SYNC_FAULTS: '{}' needs stall@ROUND:SECONDS",
                 item);
      seconds = std::stod(rest.substr(colon + 1));
      rest = rest.substr(0, colon);
    }
    int64_t round = -1;
    try {
      round = std::stoll(rest);
    } catch (const std::exception&) {
      fail("SPES_SYNC_FAULTS: '{}': the round is not a number", item);
    }
    if (kind == "nan") f.nan_round = round;
    else if (kind == "foreign") f.foreign_round = round;
    else if (kind == "scaled") f.scaled_round = round;
    else if (kind == "corrupt") f.corrupt_round = round;
    else if (kind == "replay") f.replay_round = round;
    else if (kind == "cut") f.cut_round = round;
    else if (kind == "dup") f.dup_round = round;
    else if (kind == "badname") f.badname_round = round;
    else if (kind == "poison") f.poison_round = round;
    else if (kind == "grow") f.grow_round = round;
    else if (kind == "stall") {
      f.stall_round = round;
      f.stall_s = seconds;
    } else {
      fail("SPES_SYNC_FAULTS: unknown fault '{}' (nan, foreign, scaled, badname, poison, grow, "
           "corrupt, stall, replay, cut, dup)",
           kind);
    }
  }
  return f;
}

NodeFaults node_faults_from_env() {
  const char* e = std::getenv("SPES_SYNC_FAULTS");
  return e ? parse_node_faults(e) : NodeFaults();
}

namespace {

// badname@R: a tensor name starts with these 4 bytes, replaced by invalid UTF-8 on the wire.
constexpr const char* kBadNameMarker = "BAD!";

// corrupt, cut and dup on the client's upload streams (and badname's bytes). Each acts on the first stream of its
// round that gets that far, once.
class FaultyUploadStreams : public UploadStreamFilter {
 public:
  FaultyUploadStreams(const NodeFaults& f, int64_t node) : f_(f), node_(node) {}

  uint64_t open_stream(int64_t round, uint64_t total_bytes) override {
    if (round == f_.stall_round && !stall_done_) {
      stall_done_ = true;
      spdlog::warn("node {}: fault injection: stalling {:.1f} s before round {}", node_,
                   f_.stall_s, round);
      std::this_thread::sleep_for(std::chrono::duration<double>(f_.stall_s));
    }
    round_ = round;
    index_ = 0;
    repeated_.data.clear();
    cut_after_ = round == f_.cut_round && !cut_done_ ? 4 : -1;
    repeat_ = round == f_.dup_round && !dup_done_ ? 1 : -1;
    cut_done_ = cut_done_ || cut_after_ >= 0;
    dup_done_ = dup_done_ || repeat_ >= 0;
    if (cut_after_ >= 0)
      spdlog::warn("node {}: fault injection: cutting round {}'s upload after 4 of 8 chunks",
                   node_, round);
    if (repeat_ >= 0)
      spdlog::warn("node {}: fault injection: sending chunk 1 of round {}'s upload twice", node_,
                   round);
    const bool small = round == f_.cut_round || round == f_.dup_round;
    return small ? (total_bytes + 7) / 8 : kChunkBytes;
  }

  bool send(OutgoingChunk& c, const std::function<bool(OutgoingChunk&)>& send) override {
    const int index = index_++;
    if (index == cut_after_) {
      // The stream ends early, as if the connection broke here; the server answers DATA_LOSS
      // ("upload ended after ...") and the node retries.
      spdlog::warn("node {}: fault injection: ending the round {} upload stream after {} bytes",
                   node_, round_, c.offset);
      return false;
    }
    if (index == repeat_) repeated_ = c;
    if (round_ == f_.badname_round && index == 0) {
      const size_t at = c.data.find(kBadNameMarker);
      if (at != std::string::npos) {
        c.data.replace(at, 4, "\xff\xfe\xff\xfe");  // same length: offsets stay right
        c.checksum = chunk_checksum(c.data);
      }
    }
    if (round_ == f_.corrupt_round && !corrupt_done_ && !c.data.empty()) {
      corrupt_done_ = true;
      spdlog::warn("node {}: fault injection: corrupting a chunk of round {}'s upload", node_,
                   round_);
      c.data[0] = static_cast<char>(c.data[0] ^ 0x5a);  // the checksum no longer matches
    }
    if (!send(c)) return false;
    if (index == repeat_ + 1 && !repeated_.data.empty()) {
      // The same chunk again, after the server already took it.
      repeated_.upload_checksum.clear();
      return send(repeated_);
    }
    return true;
  }

 private:
  NodeFaults f_;
  int64_t node_;
  int64_t round_ = -1;
  int index_ = 0, cut_after_ = -1, repeat_ = -1;
  bool cut_done_ = false, dup_done_ = false, corrupt_done_ = false, stall_done_ = false;
  OutgoingChunk repeated_;
};

}  // namespace

NodeFaultInjection::NodeFaultInjection(const NodeFaults& faults, int64_t node)
    : f_(faults), node_(node), filter_(std::make_shared<FaultyUploadStreams>(faults, node)) {
  spdlog::warn("node {}: SPES_SYNC_FAULTS is set: this node misbehaves on purpose "
               "(reliability tests)", node);
}

std::optional<SafetensorsStreamWriter> NodeFaultInjection::payload(const ParamRegistry& reg,
                                                                   const UploadMeta& meta,
                                                                   WireDtype wire) const {
  const int64_t r = meta.round;
  const bool grow = f_.grow_round >= 0 && r >= f_.grow_round;
  if (r != f_.nan_round && r != f_.foreign_round && r != f_.scaled_round &&
      r != f_.badname_round && r != f_.poison_round && !grow)
    return std::nullopt;
  NamedTensors t;
  for (const auto& e : reg.entries())
    if (e.trainable) t.emplace_back(e.name, e.tensor.detach());
  if (r == f_.nan_round || r == f_.scaled_round) {
    torch::Tensor bad = t.front().second.clone();
    if (r == f_.nan_round) bad.view({-1})[0] = std::nan("");
    else bad.mul_(1e6);
    t.front().second = bad;
    spdlog::warn("node {}: fault injection: round {} upload carries {}", meta.node, r,
                 r == f_.nan_round ? "a NaN" : "a tensor scaled by 1e6");
  }
  if (r == f_.badname_round) {
    // A valid marker here; the upload filter turns its bytes into invalid UTF-8 on the wire
    // (the header writer, rightly, cannot write such a name).
    t.front().first = kBadNameMarker + t.front().first;
    spdlog::warn("node {}: fault injection: round {} upload names a tensor with invalid UTF-8",
                 meta.node, r);
  }
  if (r == f_.poison_round) {
    for (auto& [name, v] : t) {
      const RegistryEntry* e = reg.find(name);
      if (!e || e->role != ParamRole::Shared || v.dim() != 1) continue;
      v = v.mul(5.0);
      spdlog::warn("node {}: fault injection: round {} upload moves '{}' by 4x its norm",
                   meta.node, r, name);
      break;
    }
  }
  if (grow) {
    // The node's own weights grow too (it downloads only the others' tensors after an accepted
    // round, and its weights must hash to what the server published).
    torch::NoGradGuard ng;
    for (auto& [name, v] : t) {
      const RegistryEntry* e = reg.find(name);
      if (e && e->role == ParamRole::Expert) {
        e->tensor.mul_(1.3);
        v = e->tensor.detach();
      }
    }
    spdlog::warn("node {}: fault injection: round {} upload carries its experts x1.3", meta.node,
                 r);
  }
  if (r == f_.foreign_round) {
    for (const auto& e : reg.entries())
      if (!e.trainable && e.role == ParamRole::Expert) {
        t.emplace_back(e.name, e.tensor.detach());
        spdlog::warn("node {}: fault injection: round {} upload carries '{}' (not its expert)",
                     meta.node, r, e.name);
        break;
      }
  }
  return SafetensorsStreamWriter(std::move(t), wire_scalar_type(wire), upload_metadata(meta));
}

void NodeFaultInjection::after_published(SyncClient& client, int64_t round,
                                         const RoundClock& clock,
                                         const SafetensorsStreamWriter& payload) const {
  if (round != f_.replay_round || round <= 1) return;
  // An old round sent again must be refused (round ids), whatever the payload.
  try {
    client.upload(round - 1, clock.step_of(round - 1), payload);
    fail("node {}: fault injection: the server accepted a replay of round {}", node_, round - 1);
  } catch (const SyncError& e) {
    SPES_CHECK(e.code() == SyncErrc::OutOfRange || e.code() == SyncErrc::FailedPrecondition,
               "node {}: replay of round {} refused with an unexpected error: {}", node_, round,
               e.what());
    spdlog::warn("node {}: fault injection: replay of round {} refused as expected: {}", node_,
                 round - 1, e.what());
  }
}

}  // namespace spes::sync
