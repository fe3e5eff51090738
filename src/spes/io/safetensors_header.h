// The safetensors header, in one place for whole files (safetensors.h: checkpoints, exports)
// and for streams (sync/wire/framing.h: uploads, downloads, the published model): an 8-byte
// little-endian length, then a JSON object name -> {dtype, shape, data_offsets} with an
// optional "__metadata__" of string pairs, padded with spaces to a multiple of 8 bytes.
// Encoding lays tensors out contiguously in the order given. Decoding trusts nothing: nesting
// depth (checked before parsing), field types, dtypes, shapes against the data size, offsets
// inside the data, no overlap, no hole, the data covered exactly; every name quoted in an
// error is made printable first. Leaves out: the tensor bytes (safetensors.h, framing.h).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace spes {

using Metadata = std::map<std::string, std::string>;

// One tensor's entry: byte offsets [begin, end) in the data section.
struct SafetensorsEntry {
  std::string name;
  torch::ScalarType dtype = torch::kFloat32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // in data order (ascending offsets, contiguous)
  Metadata metadata;
  uint64_t header_bytes = 0;  // 8 + JSON length
  uint64_t total_bytes = 0;   // header and data
};

// The header bytes (length prefix included) of `entries` (name, dtype, shape; begin and end
// are filled in: contiguous from 0, in the given order) with `metadata` first.
std::string safetensors_header_encode(std::vector<SafetensorsEntry>& entries,
                                      const Metadata& metadata);
// The JSON length in a header's first 8 bytes.
uint64_t safetensors_header_length(const char* first8);
// Decodes and checks the JSON text of a header whose data section has `data_size` bytes.
// `origin` names the source in errors (spes::Error with what is wrong).
SafetensorsHeader safetensors_header_decode(const char* json, size_t json_bytes,
                                            uint64_t data_size, const std::string& origin);

// "F32", "BF16", ... <-> torch dtype.
std::string safetensors_dtype_name(torch::ScalarType t);
torch::ScalarType safetensors_dtype_from_name(const std::string& name, const std::string& origin);

}  // namespace spes
