// The node's side of the protocol: one call per RPC over a gRPC channel with raised message
// limits. Errors come back as SyncError with the server's status mapped onto SyncErrc
// (Unavailable: the server cannot be reached, the caller may retry). TLS when given root
// certificates. Leaves out: retry policy and what to send (node.h).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "spes/sync/wire/framing.h"
#include "spes/sync/wire/protocol.h"

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
  // Streams `payload` in chunks of kChunkBytes, each with its SHA-256, and the whole stream's
  // SHA-256 in the last chunk. A repeated call for the same (round, step, size) (a retry) first
  // asks the server how many bytes an interrupted stream delivered and sends only the rest.
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
  // Fault injection (faults.h). The first chunk of the next upload stream carries a wrong
  // checksum:
  void corrupt_next_upload() { corrupt_next_ = true; }
  // Uploads go in chunks of `bytes` (0: kChunkBytes):
  void set_upload_chunk_bytes(uint64_t bytes) { chunk_bytes_ = bytes ? bytes : kChunkBytes; }
  // The next upload stream ends after `chunks` chunks (as if the connection broke there):
  void cut_next_upload_after(int chunks) { cut_after_ = chunks; }
  // The next upload stream sends its chunk `index` a second time, after chunk index + 1:
  void repeat_chunk_in_next_upload(int index) { repeat_chunk_ = index; }

 private:
  uint64_t resume_offset(int64_t round, int64_t step, uint64_t total_bytes);
  struct Impl;
  std::unique_ptr<Impl> impl_;
  NodeId id_;
  // The upload last attempted, and the payload bytes sent for it over every attempt.
  struct Attempted {
    int64_t round = -1, step = -1;
    uint64_t total = 0, sent = 0;
  } attempted_;
  uint64_t chunk_bytes_ = kChunkBytes;
  bool corrupt_next_ = false;
  int cut_after_ = -1, repeat_chunk_ = -1;
};

}  // namespace spes::sync
