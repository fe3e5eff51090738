// Protocol-level constants and plain C++ types shared by the sync server, the client and the
// tests, so that no generated protobuf type appears in a public header. The wire format itself
// is proto/spes_sync.proto; docs/PROTOCOL.md describes both. Leaves out: transport (client.h,
// server.h) and payload framing (framing.h).
#pragma once
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "spes/common/error.h"

namespace spes::sync {

// 4: chunk coding; 5: per-tensor model digest; 6: Join's must-match settings as one map;
// 7: compression topk and its settings (topk_density, topk_bits, topk_decay) in that map;
// 8: ownership epochs (the map with every round and join, the node's epoch and capacity on
// Join, Leave's kind); 9: a departing node's AdamW moments handed to its experts' next owners
// (HandOver, FetchMoments); 10: arrivals (spes_config.max_nodes a must-match setting, the
// HandOver of experts a live node lost to an arrival, metadata handover=lost).
constexpr uint32_t kProtocolVersion = 10;
constexpr uint64_t kChunkBytes = 2ull << 20;       // payload bytes per chunk we send
constexpr uint64_t kMaxChunkBytes = 4ull << 20;    // largest chunk a receiver accepts
constexpr int kMaxMessageBytes = 8 << 20;          // gRPC max send/receive message size
constexpr uint64_t kMaxHeaderBytes = 16ull << 20;  // largest safetensors header in a stream
constexpr uint32_t kMaxWaitMs = 30000;             // cap of one WaitRound long-poll
constexpr size_t kMaxDetailBytes = 500;  // refusal text kept in status, history and rounds.jsonl

// What went wrong, mapped one to one onto gRPC status codes by the transport.
enum class SyncErrc {
  InvalidArgument,     // malformed request or payload (bad names, shapes, dtypes, values)
  FailedPrecondition,  // mismatched fingerprints/settings, wrong round, not joined
  DataLoss,            // chunk checksum or stream size mismatch
  Aborted,             // the round moved on during a download: fetch again
  ResourceExhausted,   // a size bound was exceeded
  Unavailable,         // cannot reach the server (the client may retry)
  DeadlineExceeded,    // a call ran past its deadline
  OutOfRange,          // the round is closed (published without this upload): catch up
  NotJoined,           // unknown node incarnation (restarted server or node): join again
  PermissionDenied,    // unknown node or wrong token
  Internal,
};
const char* sync_errc_name(SyncErrc c);

class SyncError : public Error {
 public:
  SyncError(SyncErrc code, const std::string& msg) : Error(msg), code_(code) {}
  SyncErrc code() const { return code_; }

 private:
  SyncErrc code_;
};

template <typename... Args>
[[noreturn]] inline void sync_fail(SyncErrc code, fmt::format_string<Args...> f, Args&&... args) {
  throw SyncError(code, fmt::format(f, std::forward<Args>(args)...));
}

// One ownership epoch's map as it travels: epoch 0 is the config's; the server alone decides
// later ones (docs/PROTOCOL.md, "Ownership epochs"). `fingerprint` is Ownership::fingerprint()
// of (num_nodes, table): a receiver rebuilds the map and checks it.
struct OwnershipMap {
  int64_t epoch = 0;
  int64_t from_round = 1;    // the first round whose uploads follow it
  int64_t num_nodes = 0;
  std::vector<std::vector<int64_t>> table;  // [layer][expert] -> node
  std::string fingerprint;
  bool empty() const { return fingerprint.empty(); }
};

// Why a node leaves: the run ended for it (no handoff), or it goes for good (its experts are
// handed to live nodes at the next round boundary).
enum class LeaveKind { Finished, Departing };

struct NodeId {
  int64_t node_id = 0;
  uint64_t incarnation = 0;
  std::string auth_token;  // per-node secret (spes_config.auth_tokens_file); never logged
};

// What a node declares on Join: its protocol version, the settings it must share with the
// server (key -> value, the rows of sync/round/join_settings.h; the server compares each with
// its own) and the steps it has completed.
struct JoinInfo {
  NodeId node;
  uint32_t protocol_version = kProtocolVersion;
  std::map<std::string, std::string> settings;
  int64_t step = 0;
  // The ownership epoch the node holds (its checkpoint's; 0 for a fresh node) and that map's
  // fingerprint ("": the config's map), and the experts per layer it can train (0: no cap).
  int64_t ownership_epoch = 0;
  std::string ownership_fingerprint;
  int64_t expert_capacity = 0;
  // The memory the node can train in (GiB; 0: not declared) and the precision it trains at
  // ("fp32", "amp_bf16"; "": the run's): the server turns them into experts per layer.
  double memory_capacity_gib = 0;
  std::string precision;
};

struct JoinResult {
  uint64_t server_incarnation = 0;
  int64_t published_round = 0, published_step = 0;
  std::string model_sha256;
  uint64_t max_chunk_bytes = kMaxChunkBytes;
  uint32_t heartbeat_interval_ms = 0;
  std::vector<int64_t> published_nodes;  // nodes whose uploads the published round used
  OwnershipMap ownership;  // the map of the round being collected (the node changes to it)
};

struct RoundStatus {
  int64_t round = 0;
  bool published = false;
  int64_t step = 0;
  std::string model_sha256;
  double alpha = 0;
  // The caller's ForNode stream size if it holds round - 1 (compression: the delta, when the
  // server holds it); a node that holds another round gets the whole model instead.
  uint64_t download_bytes = 0;
  std::vector<int64_t> waiting_for;
  int64_t published_round = 0, published_step = 0;
  std::vector<int64_t> nodes;  // nodes whose uploads the round used (when published)
  // The map of the round after published_round (the one being collected): a node applying
  // the published round changes to it at that boundary.
  OwnershipMap ownership;
};

struct UploadResult {
  bool accepted = false, duplicate = false;
  uint64_t bytes = 0;
  std::string checksum;  // hex XXH3-128 of the whole stream as the server assembled it
  uint64_t resumed_from = 0;  // bytes an interrupted stream had delivered (not sent again)
  uint64_t bytes_sent = 0;    // client: chunk bytes on the wire (coded) over every attempt
};

enum class Selection { ForNode, All };

// One training step's loss (heartbeats, the dashboard's loss curves).
struct LossPoint {
  int64_t step = 0;
  double loss = 0;
};

// What a node reports with each heartbeat besides its step: its last training metrics record
// (NaN before its first step) and the losses of the steps since its previous heartbeat.
struct NodeMetrics {
  double loss = NAN;
  double tokens_per_s = NAN;
  std::vector<LossPoint> losses;
};
constexpr size_t kMaxHeartbeatLosses = 256;  // loss points one heartbeat carries at most

// One node as the server sees it (Status RPC, rounds.jsonl).
struct NodeState {
  int64_t node_id = 0;
  std::string state;       // not_joined | training | uploading | uploaded | dead | left |
                           // departed
  int64_t step = 0;
  double last_seen_s = -1;
  std::string detail;
  double loss = NAN;          // from its last heartbeat (NaN: not reported yet)
  double tokens_per_s = NAN;  // from its last heartbeat
};

struct ServerStatus {
  int64_t published_round = 0, published_step = 0, collecting_round = 0;
  std::string model_sha256;
  double round_open_s = 0;
  std::vector<NodeState> nodes;
  uint32_t protocol_version = kProtocolVersion;
  std::string publish_error;  // the collecting round closed but could not be saved (retried)
  int64_t ownership_epoch = 0;           // the collecting round's
  std::vector<int64_t> departed;         // nodes declared departed (their experts handed on)
  std::vector<std::string> frozen_experts;  // "layer:expert" that no live node owns
};

}  // namespace spes::sync
