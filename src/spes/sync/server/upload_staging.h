// Uploads of the round being collected (the one after the published round), one slot per node:
// the state of each node's upload (none, uploading, ready, folded, rejected) and the rules of a
// new stream (round ids, repeats and restarted nodes, the size bound, resuming an interrupted
// stream); each stream's checks while its bytes arrive (chunk checksums and order, a header no
// longer than the node's tensor set needs, the header against the plan, the token count,
// finite values, and its distance from the published model, per tensor, for
// spes_config.max_update_norm_ratio and the bounds of update_bounds.h); its bytes staged on disk (DIR/staging/, or
// DIR/rounds/<r>/ with keep_uploads); and the verified bytes of an interrupted stream, kept
// for a resume. Every UploadStaging method runs under its owner's (RoundState's) lock, which it
// is given: the UploadSession methods take it. The owner hears what happens through
// UploadEvents. Leaves out: who may upload (membership.h), folding (open_round.h).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "spes/io/config.h"
#include "spes/sync/round/aggregate.h"
#include "spes/sync/server/expert_drift.h"
#include "spes/sync/server/update_bounds.h"
#include "spes/sync/wire/protocol.h"

namespace spes::sync {

class UploadStaging;
struct UploadStream;  // one stream's state (upload_staging.cpp)

// One upload stream. Destroying an unfinished session keeps the verified bytes it received
// (staged file, parser state, running digest) for a resumed stream of the same node
// incarnation and round, unless the upload was rejected or superseded; the kept bytes are
// dropped when the round publishes, the node joins with a new incarnation, or a new stream of
// the node starts from offset 0.
class UploadSession {
 public:
  UploadSession(UploadStaging& staging, std::unique_ptr<UploadStream> stream);
  ~UploadSession();
  UploadSession(const UploadSession&) = delete;
  UploadSession& operator=(const UploadSession&) = delete;
  // A chunk wholly before the bytes received so far is a repeat and ignored; one overlapping
  // their end contributes only its new bytes. `data` as it arrived, coded as `encoding` says
  // (wire/chunk_coding.h; `checksum` is of its raw bytes).
  void chunk(uint64_t offset, const std::string& data, const std::string& checksum,
             uint32_t encoding = 0);
  // `expected_checksum`: the sender's checksum of the whole stream (empty: not sent; required
  // for a resumed upload, whose staged bytes are then also re-read and hashed).
  UploadResult finish(const std::string& expected_checksum = "");

 private:
  UploadStaging& staging_;
  std::unique_ptr<UploadStream> stream_;
};

// What the owner hears, with its lock held.
struct UploadEvents {
  std::function<void()> started;            // the first upload of the collecting round began
  std::function<void(int64_t node)> ready;  // a node's upload was accepted and staged
  std::function<void(int64_t node)> out;    // a node's upload was rejected: it is out
  std::function<void()> stream_ended;       // a stream ended unfinished
};

class UploadStaging {
 public:
  enum class State { None, Uploading, Ready, Folded, Rejected };
  // Empties DIR/staging. Collects round 1 until next_round() says otherwise.
  UploadStaging(const Config& cfg, const SyncModel& model, const UpdateBounds& bounds,
                ExpertDrift& experts,
                std::string dir, bool keep_uploads, std::mutex& mu, UploadEvents events);
  ~UploadStaging();

  int64_t collecting() const { return collecting_; }
  // A stream of `node`'s upload of `round` (membership already checked; `lk` holds the owner's
  // lock and is released while the staged file is created). `offset` > 0 resumes the kept
  // bytes. Throws SyncError with what the node should do when the upload cannot be taken.
  std::unique_ptr<UploadSession> begin(std::unique_lock<std::mutex>& lk, const NodeId& node,
                                       int64_t round, int64_t step, uint64_t total_bytes,
                                       uint64_t offset);
  // The bytes kept of this incarnation's interrupted stream of this upload (0: none).
  uint64_t resume_offset(const NodeId& node, int64_t round, int64_t step,
                         uint64_t total_bytes) const;
  // Drops the bytes kept for `node` (e.g. it restarted).
  void drop_kept(int64_t node, const char* why);

  State state(size_t node) const { return slots_[node].state; }
  bool arrived(size_t node) const {
    return slots_[node].state == State::Ready || slots_[node].state == State::Folded;
  }
  // A ready upload's staged file; mark_folded once the aggregator took it.
  const std::string& staged_file(size_t node) const { return slots_[node].path; }
  void mark_folded(size_t node) { slots_[node].state = State::Folded; }
  // A folded upload to be folded again (the round's sum starts over).
  void mark_ready(size_t node) {
    if (slots_[node].state == State::Folded) slots_[node].state = State::Ready;
  }
  // Why the node's upload was rejected ("" if it was not).
  const std::string& rejection(size_t node) const { return slots_[node].detail; }
  // The accepted uploads (ready or folded): node and ||upload_t - published_t||^2 per tensor.
  std::vector<std::pair<int64_t, const std::vector<double>*>> arrived_updates() const;
  // Rejects an accepted upload when the round closes (its update is an outlier among the
  // nodes'): the node is out of the round, its staged file set aside (NAME.rejected with
  // keep_uploads) or deleted. The owner refolds if it was folded.
  void reject_arrived(size_t node, const std::string& why);
  // Bytes of the node's accepted upload, chunk bytes received over every stream (repeats
  // included), and bytes a resumed stream did not need to send again.
  struct Intake {
    uint64_t bytes = 0, wire_bytes = 0, resumed_bytes = 0;
  };
  Intake intake(size_t node) const;

  // The collecting round closed (its result is being saved): new uploads are refused as
  // Unavailable and streams still open cannot be accepted into it.
  void close_round() { round_closed_ = true; }
  // The round before `round` was published: every slot starts over for `round` and kept bytes
  // are dropped.
  void next_round(int64_t round);
  // The staged files of `round`, for their removal once it is published (none with
  // keep_uploads, which keeps them).
  std::vector<std::string> staged_files(int64_t round) const;

  // For UploadSession (they take the lock where needed).
  void chunk(UploadStream& s, uint64_t offset, const std::string& data,
             const std::string& checksum, uint32_t encoding);
  UploadResult finish(UploadStream& s, const std::string& expected_checksum);
  void end(std::unique_ptr<UploadStream> s);

 private:
  struct Slot {
    State state = State::None;
    uint64_t session = 0;        // the upload session that owns `Uploading`
    std::string path;            // staged file of the accepted upload
    uint64_t bytes_in = 0;
    int64_t accepted_round = 0;  // latest round whose upload was accepted
    uint64_t accepted_incarnation = 0;  // the node incarnation that sent it
    std::string detail;          // why its upload was rejected (printable, bounded)
    std::vector<double> diff_sq;  // accepted upload: ||upload_t - published_t||^2 per tensor
    std::unique_ptr<UploadStream> kept;  // an interrupted stream, kept for a resume
    uint64_t wire_bytes = 0;     // chunk bytes received for the collecting round, every stream
    uint64_t resumed_bytes = 0;  // bytes of it that resumed streams did not need to send again
  };
  std::string staged_path(int64_t round, int64_t node) const;
  void reject(Slot& slot, int64_t node, int64_t round, const std::string& why);  // lock held
  void reject_stream(const UploadStream& s, const std::string& why);  // takes the lock
  void open_staged_file(UploadStream& s);  // without the lock
  // begin()'s steps (lock held): a resumed stream takes the kept one; a new stream is a
  // duplicate of an accepted upload, refused (closed, future, rejected round), or admitted
  // when its size is possible.
  std::unique_ptr<UploadSession> resume_kept(const NodeId& node, int64_t round, int64_t step,
                                             uint64_t total_bytes, uint64_t offset);
  void admit_new_stream(UploadStream& s);
  void check_upload_size(Slot& slot, const UploadStream& s);
  // finish()'s steps: a duplicate's answer (takes the lock); the whole stream's checksum; the
  // update bounds (a violation rejects the stream); the staged file flushed and, when resumed,
  // re-read and checked; the upload accepted (takes the lock).
  UploadResult finish_duplicate(UploadStream& s, UploadResult r);
  void check_stream_checksum(UploadStream& s, const std::string& received,
                             const std::string& expected);
  void check_update_bounds(UploadStream& s);
  void close_staged_file(UploadStream& s, const std::string& checksum);
  void accept(UploadStream& s, const UploadResult& r);

  const Config& cfg_;
  const SyncModel& model_;
  const UpdateBounds& bounds_;
  ExpertDrift& experts_;
  std::string dir_;
  bool keep_uploads_;
  std::mutex& mu_;
  UploadEvents events_;
  std::vector<Slot> slots_;
  int64_t collecting_ = 1;
  bool round_closed_ = false;
  uint64_t next_session_ = 1;
};

}  // namespace spes::sync
