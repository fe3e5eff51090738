// The file of a published round's delta D (DIR/delta.safetensors, docs/PROTOCOL.md "Compressed
// deltas"): per tensor of D, in model order, int8: "NAME:scale" (F32) then NAME (I8); bf16:
// NAME (BF16); topk: NAME (U8, [payload bytes], each its own length); metadata format "spes-delta-v1", round, from_round, model_sha256, from_sha256,
// compression, owner_exact (comma-separated model indices). Here: writing it while D is
// computed, piece by piece, without holding D (DeltaFileWriter), the record a server keeps of
// it, read back from its header, and the check that a file still holds a given record's delta.
// Leaves out: computing D (published_delta.h), serving it (server/download_session.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "spes/sync/round/plan.h"
#include "spes/sync/wire/framing.h"

namespace spes::sync {

// What a server knows of the delta file of its latest published round (kept in memory; read
// back from the file's header on restart).
struct DeltaRecord {
  int64_t round = -1, from_round = -1;
  std::string model_sha256, from_sha256;
  std::vector<size_t> tensors, owner_exact;
  bool valid() const { return round >= 1; }
};

// Writes a delta file as D is computed: each piece of a tensor's values goes straight to its
// place in a temporary file (PATH.tmp.PID); commit() then writes the header, fsyncs the file
// and renames it to PATH. The header (whose digest and owner_exact list are known only at the
// end) gets the room the largest header of this file needs, reserved at the start; a shorter
// one is padded with spaces, as safetensors allows. A failed write is remembered, never
// thrown mid-way (the caller is in the middle of turning the aggregate into the published
// model); commit() then throws. Destroying an uncommitted writer removes the temporary file.
class DeltaFileWriter {
 public:
  // `tensors`: the model indices D will hold (ascending); `owner_candidates`: those that may be
  // listed in owner_exact. Throws when the temporary file cannot be created.
  DeltaFileWriter(const RoundPlan& plan, std::string path, std::vector<size_t> tensors,
                  const std::vector<size_t>& owner_candidates, int64_t round,
                  int64_t from_round);
  ~DeltaFileWriter();
  DeltaFileWriter(const DeltaFileWriter&) = delete;
  DeltaFileWriter& operator=(const DeltaFileWriter&) = delete;

  // Values [first, first + n) of tensor i's q (n values of the delta dtype) and, with int8,
  // the scales of their blocks (`first` a multiple of kDeltaBlock).
  void write(size_t i, int64_t first, int64_t n, const void* q, const float* scales);
  // topk: tensor i's whole payload (its entry U8 [bytes]); tensors come in the order given at
  // construction, each once (the header, written by commit(), gives each its length).
  void write_payload(size_t i, const std::string& payload);
  // Completes the file with `record` (its tensors those given at construction, its
  // owner_exact among the candidates) and renames it into place. Throws when a write failed.
  void commit(const DeltaRecord& record);
  const std::string& path() const { return path_; }

 private:
  void pwrite_all(const void* data, uint64_t n, uint64_t offset);
  Metadata metadata(const DeltaRecord& r, const std::string& owner_exact) const;

  const RoundPlan& plan_;
  std::string path_, tmp_;
  std::vector<size_t> tensors_;
  std::vector<SafetensorsEntry> entries_;  // the layout (begin/end in the data section)
  std::vector<int64_t> first_entry_;       // per model tensor: its first entry (-1: not in D)
  size_t payloads_ = 0;                    // topk: payloads written so far
  uint64_t payload_end_ = 0;               // topk: data bytes written so far
  uint64_t reserved_ = 0;                  // header bytes, length prefix included
  int fd_ = -1;
  std::string error_;  // the first failed write
  bool committed_ = false;
};

// The record of a delta file from its header; throws when the header does not fit the plan.
DeltaRecord delta_record_of(const RoundPlan& plan, const StreamHeader& header,
                            const std::string& origin);
// True when the file at `path` still holds the delta `r` describes (round and digest in its
// header): a delta file replaced by a later round's is not served as this one.
bool delta_file_holds(const std::string& path, const DeltaRecord& r);
// The stream entry names of a delta download for `node`: the record's tensors (with their
// scales), less the node's owner_exact experts when `used` (the round used its upload).
std::vector<std::string> delta_download_names(const RoundPlan& plan, const DeltaRecord& r,
                                              int64_t node, bool used);

}  // namespace spes::sync
