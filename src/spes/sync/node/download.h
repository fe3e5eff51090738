// A node receiving one download stream of a published round into its registry's tensors, piece
// by piece (memory: one chunk), and resuming it after an interruption from the bytes already
// received. Two kinds of stream (docs/PROTOCOL.md): full tensors (format spes-download-v1; fp32
// or bf16 values copied in, each run checked finite) and, with compression, the round's delta
// from the round the node holds (spes-download-delta-v1): every header field is checked (the
// round and base round asked for, the compression, names in the registry in model order,
// shapes, int8 scales right before their tensor, dtypes) before any value, each scale run is
// checked finite and in range before use, and each tensor becomes prev + deq(D) with the
// shared kernel, prev being the node's base for a trainable tensor (DeltaUpload) and its
// current value for a frozen one. The caller verifies the published digest afterwards (and
// falls back to a full download on a mismatch). Leaves out: retries and the round logic
// (node.cpp).
#pragma once
#include <cstdint>
#include <memory>
#include <set>
#include <string>

#include "spes/model/registry.h"
#include "spes/sync/node/client.h"
#include "spes/sync/round/delta_upload.h"
#include "spes/sync/wire/delta_codec.h"
#include "spes/sync/wire/framing.h"
#include "spes/sync/wire/protocol.h"

namespace spes::sync {

class DownloadReceiver {
 public:
  // `delta`: the node's compressed-upload state (null or disabled: a delta stream is refused);
  // `from_round`: the published round the node holds and asks a delta from (-1: none).
  DownloadReceiver(const ParamRegistry& reg, int64_t round, Selection sel, WireDtype wire,
                   const DeltaUpload* delta = nullptr, int64_t from_round = -1);
  // Starts the stream (first call) or checks that a resumed one has the same size.
  void begin(uint64_t total);
  void feed(const char* data, size_t n);
  bool started() const { return reader_ != nullptr; }
  uint64_t consumed() const { return reader_ ? reader_->consumed() : 0; }
  bool done() const { return reader_ && reader_->consumed() == total_; }
  // The stream was a delta (else full tensors).
  bool is_delta() const { return delta_stream_; }
  // Tensors received completely.
  const std::set<std::string>& names() const { return names_; }

 private:
  void check_header(const StreamHeader& h);
  void check_delta_header(const StreamHeader& h);
  void full_run(const StreamEntry& e, int64_t first, const torch::Tensor& run, bool last);
  torch::Tensor prev_of(const StreamEntry& e);

  const ParamRegistry& reg_;
  int64_t round_;
  Selection sel_;
  WireDtype wire_;
  const DeltaUpload* delta_;
  int64_t from_round_;
  std::string origin_;
  uint64_t total_ = 0;
  std::unique_ptr<SafetensorsStreamReader> reader_;
  std::unique_ptr<DeltaStreamDecoder> decoder_;
  bool delta_stream_ = false;
  std::string prev_name_;
  torch::Tensor prev_;
  std::set<std::string> names_;
};

// A download over the client that survives interruptions: each attempt resumes from the bytes
// already received (the server serves the same persisted bytes again).
struct Download {
  DownloadReceiver receiver;
  int64_t round;
  Selection sel;
  int64_t from_round;
  Download(const ParamRegistry& reg, int64_t round, Selection sel, WireDtype wire,
           const DeltaUpload* delta = nullptr, int64_t from_round = -1)
      : receiver(reg, round, sel, wire, delta, from_round), round(round), sel(sel),
        from_round(from_round) {}
  // One attempt; returns the bytes it received.
  uint64_t attempt(SyncClient& client);
};

}  // namespace spes::sync
