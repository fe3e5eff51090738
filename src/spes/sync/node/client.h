// The node's side of the protocol: one call per RPC over a gRPC channel with raised message
// limits. Errors come back as SyncError with the server's status mapped onto SyncErrc
// (Unavailable: the server cannot be reached, the caller may retry). TLS when given root
// certificates; plaintext only to a loopback server unless told `insecure`. Every call carries
// the node id and token (and for Status the read token) as call metadata, never in a body.
// Leaves out: retry policy and what to send (node.h), fault injection (faults.h, through
// UploadStreamFilter).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "spes/sync/wire/framing.h"
#include "spes/sync/wire/protocol.h"

namespace spes::sync {

// TLS for the channel (PEM contents). Empty root_pem: plaintext, refused for a server off
// loopback unless `insecure`; a client certificate without root_pem is refused.
struct ClientTls {
  std::string root_pem, cert_pem, key_pem;
  bool insecure = false;  // allow plaintext to a non-loopback server (--insecure)
};

// One chunk of an upload stream as the client sends it.
struct OutgoingChunk {
  uint64_t offset = 0;
  std::string data, checksum;   // the bytes and their checksum (wire/checksum.h)
  std::string upload_checksum;  // the whole stream's checksum, on its last chunk
};

// Stands between an upload stream and the wire: the client hands it each chunk and the
// function that sends one. Without a filter every chunk goes out once, as it is, in chunks of
// kChunkBytes. Fault injection (faults.h) is one.
class UploadStreamFilter {
 public:
  virtual ~UploadStreamFilter() = default;
  // A stream of round `round`'s upload (`total_bytes` in all) opens; returns its chunk size.
  virtual uint64_t open_stream(int64_t round, uint64_t total_bytes) = 0;
  // Sends `chunk` (or something else) with `send`, which returns false once the server ended
  // the stream. Returns false to end the stream here.
  virtual bool send(OutgoingChunk& chunk, const std::function<bool(OutgoingChunk&)>& send) = 0;
};

class SyncClient {
 public:
  SyncClient(const std::string& address, NodeId id, const ClientTls& tls = {});
  ~SyncClient();
  const NodeId& id() const { return id_; }
  // Waits until the channel is connected; false after timeout_s. Tries at once (the channel's
  // reconnect backoff, at most 1 s, is reset first): a restarted server is found as soon as
  // it listens.
  bool wait_connected(double timeout_s);
  // Waits before a call is retried: when the channel is not connected (a restarted or
  // unreachable server), until it connects again, at most `backoff_s`; when it is connected
  // (the server refused the call, e.g. its rate limit or thread cap), the whole `backoff_s`, so
  // that a refused call is never retried at once.
  void wait_before_retry(double backoff_s);
  JoinResult join(const JoinInfo& info);
  // Streams `payload` in chunks of kChunkBytes, each with its checksum (wire/checksum.h), and
  // the whole stream's checksum in the last chunk; each chunk zstd-coded when chunk coding is
  // on and that makes it smaller. A repeated call for the same (round, step, size) (a retry)
  // first asks the server how many bytes an interrupted stream delivered and sends only the
  // rest.
  UploadResult upload(int64_t round, int64_t step, const SafetensorsStreamWriter& payload);
  RoundStatus wait_round(int64_t round, uint32_t max_wait_ms);
  // Streams a round's download from byte `offset` on: `on_begin(total_bytes)` once per call,
  // then `on_data` for each verified chunk in order. Returns the bytes received by this call.
  // `from_round` >= 0: the published round the node holds (DownloadRequest.from_round).
  uint64_t download(int64_t round, Selection selection,
                    const std::function<void(uint64_t)>& on_begin,
                    const std::function<void(const char*, size_t)>& on_data,
                    uint64_t offset = 0, int64_t from_round = -1);
  void leave(int64_t step, const std::string& reason, LeaveKind kind = LeaveKind::Finished);
  // Protocol 9: streams a departing node's moments (round/moments_handoff.h) to the server
  // (sent again from the start by a retry). Returns the experts the server kept.
  int64_t hand_over(const SafetensorsStreamWriter& payload);
  // Protocol 9: the moments handed over for the experts this node gains in ownership epoch
  // `epoch` (a safetensors stream; refused when the server announces more than `max_bytes`).
  std::string fetch_moments(int64_t epoch, uint64_t max_bytes);
  // Reports the node's step and metrics; returns the server's latest published round.
  int64_t heartbeat(int64_t step, const NodeMetrics& metrics = {});
  // Needs `read_token` when the server has one or listens off loopback.
  ServerStatus status(const std::string& read_token = "");
  // Sends every upload stream through `filter` from now on (null: none).
  void set_upload_filter(std::shared_ptr<UploadStreamFilter> filter) {
    filter_ = std::move(filter);
  }
  // Chunk coding (wire/chunk_coding.h, spes_config.wire_coding) from now on: uploads send
  // chunks zstd-coded where that makes them smaller, downloads ask the server for the same.
  void set_chunk_coding(bool zstd) { zstd_ = zstd; }
  // Bytes of download chunks as they crossed the wire (coded sizes), over every download of
  // this client.
  uint64_t download_wire_bytes() const { return download_wire_bytes_; }

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
  std::shared_ptr<UploadStreamFilter> filter_;
  bool zstd_ = false;
  uint64_t download_wire_bytes_ = 0;
};

}  // namespace spes::sync
