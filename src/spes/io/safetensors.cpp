// safetensors reader/writer (see safetensors.h). The header is JSON (nlohmann); the reader
// checks that offsets lie inside the data, do not overlap, cover it exactly, and agree with
// dtype x shape, so a file whose header lies is rejected with a message saying how.
#include "spes/io/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>

#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/io/files.h"

namespace spes {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // the format's own limit is 100 MB

size_t dtype_size(torch::ScalarType t) { return c10::elementSize(t); }

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

std::string safetensors_serialize(const NamedTensors& tensors, const Metadata& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<torch::Tensor> cpu;
  cpu.reserve(tensors.size());
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    SPES_CHECK(name != "__metadata__", "safetensors: '__metadata__' is not a tensor name");
    SPES_CHECK(!header.contains(name), "safetensors: duplicate tensor name '{}'", name);
    torch::Tensor c = t.detach().to(torch::kCPU).contiguous();
    uint64_t n = static_cast<uint64_t>(c.numel()) * dtype_size(c.scalar_type());
    header[name] = {{"dtype", safetensors_dtype_name(c.scalar_type())},
                    {"shape", c.sizes().vec()},
                    {"data_offsets", {offset, offset + n}}};
    offset += n;
    cpu.push_back(c);
  }
  std::string h = header.dump();
  while ((8 + h.size()) % 8 != 0) h.push_back(' ');  // align the data section to 8 bytes
  std::string out;
  out.resize(8 + h.size() + offset);
  uint64_t hl = h.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((hl >> (8 * i)) & 0xff);
  std::memcpy(&out[8], h.data(), h.size());
  size_t pos = 8 + h.size();
  for (const auto& c : cpu) {
    size_t n = c.numel() * dtype_size(c.scalar_type());
    if (n) std::memcpy(&out[pos], c.data_ptr(), n);
    pos += n;
  }
  return out;
}

NamedTensors safetensors_parse(const std::string& bytes, Metadata* metadata,
                               const std::string& origin) {
  SPES_CHECK(bytes.size() >= 8, "{}: truncated safetensors data ({} bytes, need at least 8)",
             origin, bytes.size());
  uint64_t hl = 0;
  for (int i = 0; i < 8; ++i) hl |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
  SPES_CHECK(hl <= kMaxHeaderBytes, "{}: safetensors header length {} exceeds the 100 MB limit",
             origin, hl);
  SPES_CHECK(8 + hl <= bytes.size(), "{}: safetensors header length {} runs past the end of the "
             "data ({} bytes): the file is truncated or not safetensors", origin, hl, bytes.size());
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + hl);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: safetensors header is not valid JSON ({})", origin, e.what());
  }
  SPES_CHECK(header.is_object(), "{}: safetensors header must be a JSON object", origin);
  const uint64_t data_size = bytes.size() - 8 - hl;
  const char* data = bytes.data() + 8 + hl;

  struct Entry {
    std::string name;
    torch::ScalarType dtype;
    std::vector<int64_t> shape;
    uint64_t begin, end;
  };
  std::vector<Entry> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      SPES_CHECK(it->is_object(), "{}: __metadata__ must be an object of strings", origin);
      if (metadata) {
        for (auto m = it->begin(); m != it->end(); ++m) {
          SPES_CHECK(m->is_string(), "{}: __metadata__ value '{}' is not a string", origin, m.key());
          (*metadata)[m.key()] = m->get<std::string>();
        }
      }
      continue;
    }
    const auto& v = *it;
    const std::string& name = it.key();
    SPES_CHECK(v.is_object() && v.contains("dtype") && v.contains("shape") &&
                   v.contains("data_offsets") && v["dtype"].is_string() &&
                   v["shape"].is_array() && v["data_offsets"].is_array() &&
                   v["data_offsets"].size() == 2,
               "{}: tensor '{}' needs dtype (string), shape (array) and data_offsets ([begin, "
               "end])", origin, name);
    Entry e;
    e.name = name;
    e.dtype = safetensors_dtype_from_name(v["dtype"].get<std::string>(), origin);
    uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      SPES_CHECK(d.is_number_unsigned(), "{}: tensor '{}' has a negative or non-integer dimension",
                 origin, name);
      uint64_t x = d.get<uint64_t>();
      SPES_CHECK(x <= data_size && (x == 0 || numel <= data_size / x),
                 "{}: tensor '{}' has an absurd shape (more elements than the file has bytes)",
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
    SPES_CHECK(e.end - e.begin == numel * dtype_size(e.dtype),
               "{}: tensor '{}' occupies {} bytes but dtype x shape needs {}", origin, name,
               e.end - e.begin, numel * dtype_size(e.dtype));
    entries.push_back(std::move(e));
  }
  // Offsets must not overlap (and, per the format, cover the data without holes).
  std::vector<const Entry*> order;
  for (const auto& e : entries) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t expect = 0;
  for (const Entry* e : order) {
    SPES_CHECK(e->begin >= expect || e->begin == e->end,
               "{}: tensor '{}' overlaps the previous tensor's bytes", origin, e->name);
    SPES_CHECK(e->begin <= expect || e->begin == e->end,
               "{}: hole in the data section before tensor '{}'", origin, e->name);
    expect = std::max(expect, e->end);
  }
  SPES_CHECK(expect == data_size, "{}: data section has {} bytes but tensors cover {}", origin,
             data_size, expect);

  NamedTensors out;
  out.reserve(entries.size());
  // Keep the header order stable by data offset (files we write store tensors in order).
  for (const Entry* e : order) {
    torch::Tensor t = torch::empty(e->shape, torch::TensorOptions().dtype(e->dtype));
    if (e->end > e->begin) std::memcpy(t.data_ptr(), data + e->begin, e->end - e->begin);
    out.emplace_back(e->name, t);
  }
  return out;
}

void safetensors_save(const std::string& path, const NamedTensors& tensors,
                      const Metadata& metadata) {
  file_write_atomic(path, safetensors_serialize(tensors, metadata));
}

NamedTensors safetensors_load(const std::string& path, Metadata* metadata) {
  return safetensors_parse(file_read(path), metadata, path);
}

}  // namespace spes
