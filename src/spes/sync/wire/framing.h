// Payload framing: a sync payload (an upload or a download) is one safetensors byte stream,
// produced and consumed piece by piece so that neither side materialises it: the writer
// converts each tensor to the wire dtype (fp32 or bf16) only for the bytes asked for, and the
// reader parses the header as soon as it has arrived and hands out each tensor when its last
// byte arrives (memory: one tensor). Chunks of the stream travel with their hex SHA-256.
// The stream writer emits exactly the bytes safetensors_serialize would. Leaves out:
// transport (client/server) and what the tensors mean (plan.h, aggregate.h).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "spes/io/config.h"
#include "spes/io/safetensors.h"

namespace spes::sync {

// The dtype tensors travel in. In memory everything stays fp32.
enum class WireDtype { F32, BF16 };
WireDtype wire_dtype_of(TransferDtype d);               // spes_config.transfer_dtype
const char* wire_dtype_name(WireDtype d);                // "fp32" | "bf16"
torch::ScalarType wire_scalar_type(WireDtype d);
// Rounds fp32 values in place to what the wire carries (identity for fp32).
void wire_round_(const torch::Tensor& t, WireDtype d);

// Writes a safetensors stream of `tensors` (cast to `dtype`) on demand.
class SafetensorsStreamWriter {
 public:
  SafetensorsStreamWriter(NamedTensors tensors, torch::ScalarType dtype, Metadata metadata);
  // The same stream with values read on demand (pread, one piece at a time) from an fp32
  // safetensors file instead of memory: `names` (a subset of the file's tensors, in stream
  // order). The file is opened now and stays readable even if it is replaced (renamed over)
  // later, so a stream keeps serving the version it started with.
  static SafetensorsStreamWriter from_file(const std::string& path,
                                           const std::vector<std::string>& names,
                                           torch::ScalarType dtype, Metadata metadata);
  // The same from a file of any dtypes, each tensor sent in its own dtype, unconverted (e.g.
  // a published delta's I8 values and F32 scales).
  static SafetensorsStreamWriter from_file_as_stored(const std::string& path,
                                                     const std::vector<std::string>& names,
                                                     Metadata metadata);
  // The stream of `tensors` each in its own dtype (no conversion; e.g. a compressed upload's
  // I8 values and F32 scales).
  static SafetensorsStreamWriter as_stored(NamedTensors tensors, Metadata metadata);
  uint64_t total_bytes() const { return header_.size() + data_bytes_; }
  uint64_t header_bytes() const { return header_.size(); }
  uint64_t data_bytes() const { return data_bytes_; }
  // Appends bytes [offset, offset + n) of the stream to `out` (n is clipped at the end).
  void read(uint64_t offset, uint64_t n, std::string* out) const;

 private:
  SafetensorsStreamWriter() = default;
  void build_header(const std::vector<std::pair<std::string, std::vector<int64_t>>>& shapes,
                    Metadata metadata);
  // from_file / from_file_as_stored: `dtype` undefined keeps each tensor's file dtype.
  static SafetensorsStreamWriter open_file(const std::string& path,
                                           const std::vector<std::string>& names,
                                           std::optional<torch::ScalarType> dtype,
                                           Metadata metadata);
  struct Item {
    torch::Tensor flat;  // contiguous 1-D view of the source tensor (memory source)
    uint64_t begin, end; // byte range in the stream
    uint64_t file_offset = 0;  // file source: byte offset of the values in the file
    torch::ScalarType dtype = torch::kFloat32;  // on the wire
    torch::ScalarType file_dtype = torch::kFloat32;  // file source: as stored
  };
  std::shared_ptr<int> fd_;  // file source (closed with the last copy)
  std::string header_;  // 8-byte length + JSON header, padded to 8
  std::vector<Item> items_;
  uint64_t data_bytes_ = 0;
};

// A stream's header: the safetensors header (the codec shared with files).
using StreamEntry = SafetensorsEntry;
using StreamHeader = SafetensorsHeader;

// Parses a safetensors stream fed in pieces of any size. `on_header` sees the parsed header
// before any data (throw to reject); `on_tensor` receives each tensor (CPU, the stream's dtype)
// once complete. The header must describe exactly `total_bytes` with no holes or overlaps.
// Slice mode (set_slice_handler) hands out each tensor instead as consecutive 1-D runs of whole
// elements as their bytes arrive, so memory stays at one piece whatever the tensor size.
class SafetensorsStreamReader {
 public:
  using HeaderFn = std::function<void(const StreamHeader&)>;
  using TensorFn = std::function<void(const StreamEntry&, const torch::Tensor&)>;
  // `first`: index of the run's first element in the flattened tensor; `last`: the tensor ends
  // with this run (an empty tensor gives one empty run).
  using SliceFn = std::function<void(const StreamEntry&, int64_t first, const torch::Tensor& run,
                                     bool last)>;
  SafetensorsStreamReader(uint64_t total_bytes, std::string origin, HeaderFn on_header,
                          TensorFn on_tensor, uint64_t max_header_bytes = 16ull << 20);
  // Switches to slice mode (before the first feed).
  void set_slice_handler(SliceFn on_slice) { on_slice_ = std::move(on_slice); }
  void feed(const char* data, size_t n);
  // Throws unless every byte of the stream has been fed.
  void finish() const;
  uint64_t consumed() const { return consumed_; }
  bool has_header() const { return parsed_; }
  const StreamHeader& header() const { return header_; }

 private:
  void parse_header();
  void feed_data(const char* data, size_t n);

  uint64_t total_, max_header_;
  std::string origin_;
  HeaderFn on_header_;
  TensorFn on_tensor_;
  SliceFn on_slice_;
  std::string carry_;         // slice mode: bytes of a partial element
  uint64_t consumed_ = 0;
  std::string head_;  // header bytes until parsed
  bool parsed_ = false;
  StreamHeader header_;
  size_t next_ = 0;           // entry being filled
  torch::Tensor current_;     // its buffer
  uint64_t current_fill_ = 0; // bytes of it received
};

// Streams a file through a reader (4 MiB at a time). The reader's total must be the file size.
void stream_file(const std::string& path, SafetensorsStreamReader& reader);
// Parses a stream's header from a file (reads only the header).
StreamHeader read_stream_header(const std::string& path);
// Writes a stream to `path` atomically and durably, piece by piece: a temporary name written
// past the page cache and fsynced (file_write_direct, io/files.h), renamed into place, the
// directory fsynced. With `set_aside_replaced`, a file already at `path` is moved aside
// (file_replace) for the caller to remove later instead of being freed here: returns its new
// name ("" when there was none, or without `set_aside_replaced`). `amend_head`: as for
// file_write_direct.
std::string write_stream_file(const std::string& path, const SafetensorsStreamWriter& writer,
                              bool set_aside_replaced = false,
                              const std::function<void(std::string* head)>& amend_head = nullptr);

// True when the file holds exactly the writer's bytes.
bool stream_equals_file(const SafetensorsStreamWriter& writer, const std::string& path);

}  // namespace spes::sync
