// TensorBoard event files written natively, for `tensorboard --logdir` and any reader of its
// format: DIR/events.out.tfevents.<unix seconds>.<host>.<pid>, a TFRecord file (each record: its
// length, the masked CRC-32C of the length, the bytes, their masked CRC-32C) of Event protobufs
// encoded here by hand (wall_time, step, and a Summary of simple_value scalars; the first event
// names the file version "brain.Event:2"). Each event is flushed as it is written, so that a
// live TensorBoard follows the run; a continued run opens a file of its own next to the
// earlier ones. Used by the trainer (metrics.jsonl's figures) and the sync server (rounds.jsonl's).
// Leaves out: histograms, images, text, hyper-parameters (only scalars).
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace spes {

using Scalars = std::vector<std::pair<std::string, double>>;  // (tag, value)

// Which numbers of a JSON record become which scalars: {"loss", "train/loss"}.
struct ScalarKey {
  const char* key;
  const char* tag;
};

class TensorBoardWriter {
 public:
  // Creates DIR's event file and writes its first event; refuses with the path and the reason
  // when the file cannot be created.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One event at `step` holding `values` (nothing when empty).
  void write(int64_t step, double wall_time, const Scalars& values);
  // One event with every number of `record` that `keys` names (missing and non-numeric keys are
  // left out).
  void write(int64_t step, double wall_time, const nlohmann::json& record,
             const std::vector<ScalarKey>& keys);
  const std::string& path() const { return path_; }

 private:
  void append(const std::string& event);
  std::string path_;
  std::FILE* f_ = nullptr;
};

// One TFRecord: little-endian u64 length, masked CRC-32C of those 8 bytes, the data, masked
// CRC-32C of the data.
std::string tfrecord_frame(std::string_view data);
// An Event protobuf with wall_time, step and a Summary of one simple_value (float) per value.
std::string encode_scalar_event(double wall_time, int64_t step, const Scalars& values);
// The first Event of a file: wall_time and file_version "brain.Event:2".
std::string encode_file_version_event(double wall_time);

}  // namespace spes
