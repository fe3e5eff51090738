// The safetensors header codec (see safetensors_header.h).
#include "spes/io/safetensors_header.h"

#include <nlohmann/json.hpp>

#include <algorithm>

#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/io/json_depth.h"

namespace spes {

namespace {
// A header nests 3 deep (object of tensor objects holding arrays); deeper text costs memory
// and time to parse and is refused before parsing.
constexpr int kMaxHeaderDepth = 4;

}  // namespace

std::string safetensors_dtype_name(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat32: return "F32";
    case torch::kFloat16: return "F16";
    case torch::kBFloat16: return "BF16";
    case torch::kFloat64: return "F64";
    case torch::kInt64: return "I64";
    case torch::kInt32: return "I32";
    case torch::kInt16: return "I16";
    case torch::kInt8: return "I8";
    case torch::kUInt8: return "U8";
    case torch::kBool: return "BOOL";
    default: fail("safetensors: dtype {} cannot be stored", c10::toString(t));
  }
}

torch::ScalarType safetensors_dtype_from_name(const std::string& n, const std::string& origin) {
  if (n == "F32") return torch::kFloat32;
  if (n == "F16") return torch::kFloat16;
  if (n == "BF16") return torch::kBFloat16;
  if (n == "F64") return torch::kFloat64;
  if (n == "I64") return torch::kInt64;
  if (n == "I32") return torch::kInt32;
  if (n == "I16") return torch::kInt16;
  if (n == "I8") return torch::kInt8;
  if (n == "U8") return torch::kUInt8;
  if (n == "BOOL") return torch::kBool;
  fail("{}: unsupported safetensors dtype '{}' (expected F32, F16, BF16, F64, I64, I32, I16, I8, "
       "U8 or BOOL)", origin, printable(n, 40));
}

std::string safetensors_header_encode(std::vector<SafetensorsEntry>& entries,
                                      const Metadata& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (auto& e : entries) {
    SPES_CHECK(e.name != "__metadata__", "safetensors: '__metadata__' is not a tensor name");
    SPES_CHECK(!header.contains(e.name), "safetensors: duplicate tensor name '{}'", e.name);
    uint64_t numel = 1;
    for (int64_t d : e.shape) numel *= static_cast<uint64_t>(d);
    e.begin = offset;
    e.end = offset + numel * c10::elementSize(e.dtype);
    header[e.name] = {{"dtype", safetensors_dtype_name(e.dtype)},
                      {"shape", e.shape},
                      {"data_offsets", {e.begin, e.end}}};
    offset = e.end;
  }
  std::string h = header.dump();
  while ((8 + h.size()) % 8 != 0) h.push_back(' ');  // the data section starts 8-aligned
  std::string out(8, '\0');
  const uint64_t hl = h.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((hl >> (8 * i)) & 0xff);
  return out + h;
}

uint64_t safetensors_header_length(const char* first8) {
  uint64_t hl = 0;
  for (int i = 0; i < 8; ++i) hl |= static_cast<uint64_t>(static_cast<uint8_t>(first8[i])) << (8 * i);
  return hl;
}

SafetensorsHeader safetensors_header_decode(const char* json, size_t json_bytes,
                                            uint64_t data_size, const std::string& origin) {
  SPES_CHECK(json_depth(json, json + json_bytes, kMaxHeaderDepth) <= kMaxHeaderDepth,
             "{}: safetensors header nests deeper than {} levels (a header is an object of "
             "tensor objects)", origin, kMaxHeaderDepth);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json, json + json_bytes);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: safetensors header is not valid JSON ({})", origin, printable(e.what()));
  }
  SPES_CHECK(j.is_object(), "{}: safetensors header must be a JSON object", origin);
  SafetensorsHeader out;
  out.header_bytes = 8 + json_bytes;
  out.total_bytes = out.header_bytes + data_size;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string name = printable(it.key());  // for messages: the name came from outside
    if (it.key() == "__metadata__") {
      SPES_CHECK(it->is_object(), "{}: __metadata__ must be an object of strings", origin);
      for (auto m = it->begin(); m != it->end(); ++m) {
        SPES_CHECK(m->is_string(), "{}: __metadata__ value '{}' is not a string", origin,
                   printable(m.key()));
        out.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    const auto& v = *it;
    SPES_CHECK(v.is_object() && v.contains("dtype") && v.contains("shape") &&
                   v.contains("data_offsets") && v["dtype"].is_string() &&
                   v["shape"].is_array() && v["data_offsets"].is_array() &&
                   v["data_offsets"].size() == 2,
               "{}: tensor '{}' needs dtype (string), shape (array) and data_offsets ([begin, "
               "end])", origin, name);
    SafetensorsEntry e;
    e.name = it.key();
    e.dtype = safetensors_dtype_from_name(v["dtype"].get<std::string>(), origin);
    uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      SPES_CHECK(d.is_number_unsigned(), "{}: tensor '{}' has a negative or non-integer "
                 "dimension", origin, name);
      const uint64_t x = d.get<uint64_t>();
      SPES_CHECK(x <= data_size && (x == 0 || numel <= data_size / x),
                 "{}: tensor '{}' has an absurd shape (more elements than the data has bytes)",
                 origin, name);
      numel *= x;
      e.shape.push_back(static_cast<int64_t>(x));
    }
    for (const auto& d : v["data_offsets"])
      SPES_CHECK(d.is_number_unsigned(), "{}: tensor '{}' has a non-integer data offset", origin,
                 name);
    e.begin = v["data_offsets"][0].get<uint64_t>();
    e.end = v["data_offsets"][1].get<uint64_t>();
    SPES_CHECK(e.begin <= e.end && e.end <= data_size,
               "{}: tensor '{}' data_offsets [{}, {}] lie outside the data section ({} bytes)",
               origin, name, e.begin, e.end, data_size);
    SPES_CHECK(e.end - e.begin == numel * c10::elementSize(e.dtype),
               "{}: tensor '{}' occupies {} bytes but dtype x shape needs {}", origin, name,
               e.end - e.begin, numel * c10::elementSize(e.dtype));
    out.entries.push_back(std::move(e));
  }
  // In data order; the tensors cover the data section exactly, without overlap or hole.
  auto& es = out.entries;
  std::stable_sort(es.begin(), es.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expect = 0;
  for (const auto& e : es) {
    if (e.begin == e.end) continue;
    SPES_CHECK(e.begin >= expect, "{}: tensor '{}' overlaps the previous tensor's bytes", origin,
               printable(e.name));
    SPES_CHECK(e.begin == expect, "{}: hole in the data section before tensor '{}'", origin,
               printable(e.name));
    expect = e.end;
  }
  SPES_CHECK(expect == data_size, "{}: data section has {} bytes but tensors cover {}", origin,
             data_size, expect);
  return out;
}

}  // namespace spes
