// The node's side of the protocol: one call per RPC over a gRPC channel with raised message
// limits. Errors come back as SyncError with the server's status mapped onto SyncErrc
// (Unavailable: the server cannot be reached, the caller may retry). TLS when given root
// certificates. Leaves out: retry policy and what to send (node.h).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "spes/sync/framing.h"
#include "spes/sync/protocol.h"

namespace spes::sync {

// TLS for the channel (PEM contents). Empty root_pem: plaintext.
struct ClientTls {
  std::string root_pem, cert_pem, key_pem;
};

class SyncClient {
 public:
  SyncClient(const std::string& address, NodeId id, const ClientTls& tls = {});
  ~SyncClient();
  const NodeId& id() const { return id_; }
  // Waits until the channel is connected; false after timeout_s.
  bool wait_connected(double timeout_s);
  JoinResult join(const JoinInfo& info);
  // Streams `payload` in chunks of kChunkBytes, each with its SHA-256.
  UploadResult upload(int64_t round, int64_t step, const SafetensorsStreamWriter& payload);
  RoundStatus wait_round(int64_t round, uint32_t max_wait_ms);
  // Streams a round's download from byte `offset` on: `on_begin(total_bytes)` once per call,
  // then `on_data` for each verified chunk in order. Returns the bytes received by this call.
  uint64_t download(int64_t round, Selection selection,
                    const std::function<void(uint64_t)>& on_begin,
                    const std::function<void(const char*, size_t)>& on_data,
                    uint64_t offset = 0);
  void leave(int64_t step, const std::string& reason);
  // Reports the node's step and metrics; returns the server's latest published round.
  int64_t heartbeat(int64_t step, const NodeMetrics& metrics = {});
  ServerStatus status();
  // Fault injection (faults.h): the first chunk of the next upload carries a wrong checksum.
  void corrupt_next_upload() { corrupt_next_ = true; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  NodeId id_;
  bool corrupt_next_ = false;
};

}  // namespace spes::sync
