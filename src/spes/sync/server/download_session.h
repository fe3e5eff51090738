// Downloads of a published round: which tensors a node's download holds (the part for the node,
// or the whole model; with compression the round's delta for a node that holds the previous
// round, else the whole model), served from the persisted published.safetensors (or
// delta.safetensors) through a descriptor
// opened when the download begins (a later publication, a rename over the file, does not
// change its bytes), and one download stream that resumes from an offset and reports when it
// has sent everything. Leaves out: which round may be downloaded (RoundState).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "spes/sync/round/plan.h"
#include "spes/sync/server/round_store.h"
#include "spes/sync/wire/framing.h"
#include "spes/sync/wire/protocol.h"

namespace spes::sync {

// The delta of the published round a download may be served from (compression only).
struct DeltaSource {
  const DeltaRecord* record = nullptr;  // null or invalid: no delta held (e.g. restarted)
  std::string path;                     // its file
  int64_t from_round = -1;              // the round the node says it holds (-1: none)
};

// The stream of round `round` (`published`, persisted at `path`) for `node`: with
// Selection::ForNode (and round > 0) the tensors the node lacks (plan.download_for); a node
// whose upload the round did not use gets its own experts back too. With compression,
// ForNode is the delta (format spes-download-delta-v1, delta_download_names) when `delta`
// holds this round's delta from the round the node holds (and its file still does), and the
// whole model otherwise.
std::unique_ptr<SafetensorsStreamWriter> download_writer(const RoundPlan& plan,
                                                         const PublishedRound& published,
                                                         const std::string& path, int64_t node,
                                                         int64_t round, Selection selection,
                                                         const DeltaSource& delta = {});

// One download stream of a published round.
class DownloadSession {
 public:
  // Sends `writer`'s bytes from `offset` on; `on_complete(bytes sent by this stream, the same
  // as they crossed the wire)` runs once, when next() finds everything sent.
  DownloadSession(std::unique_ptr<SafetensorsStreamWriter> writer, int64_t round, uint64_t offset,
                  std::function<void(uint64_t, uint64_t)> on_complete);
  ~DownloadSession();
  uint64_t total_bytes() const;
  int64_t round() const { return round_; }
  // The next chunk (at most kChunkBytes); false once everything was sent.
  bool next(std::string* data, uint64_t* offset);
  // The last chunk went out as `wire_bytes` (coded, wire/chunk_coding.h).
  void sent_on_wire(uint64_t wire_bytes) { wire_ += wire_bytes; }

 private:
  std::unique_ptr<SafetensorsStreamWriter> writer_;
  int64_t round_;
  uint64_t offset_, start_, wire_ = 0;
  std::function<void(uint64_t, uint64_t)> on_complete_;
  bool reported_ = false;
};

}  // namespace spes::sync
