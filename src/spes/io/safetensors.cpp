// safetensors reader/writer (see safetensors.h): whole files and byte strings; the header and
// its checks are safetensors_header.h's, shared with the sync streams.
#include "spes/io/safetensors.h"

#include <algorithm>
#include <cstring>

#include "spes/common/error.h"
#include "spes/io/files.h"

namespace spes {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // the format's own limit is 100 MB

}  // namespace

std::string safetensors_serialize(const NamedTensors& tensors, const Metadata& metadata) {
  std::vector<SafetensorsEntry> entries;
  std::vector<torch::Tensor> cpu;
  cpu.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    torch::Tensor c = t.detach().to(torch::kCPU).contiguous();
    entries.push_back({name, c.scalar_type(), c.sizes().vec()});
    cpu.push_back(c);
  }
  const std::string header = safetensors_header_encode(entries, metadata);
  std::string out;
  out.resize(header.size() + (entries.empty() ? 0 : entries.back().end));
  std::memcpy(&out[0], header.data(), header.size());
  for (size_t k = 0; k < cpu.size(); ++k) {
    const uint64_t n = entries[k].end - entries[k].begin;
    if (n) std::memcpy(&out[header.size() + entries[k].begin], cpu[k].data_ptr(), n);
  }
  return out;
}

NamedTensors safetensors_parse(const std::string& bytes, Metadata* metadata,
                               const std::string& origin) {
  SPES_CHECK(bytes.size() >= 8, "{}: truncated safetensors data ({} bytes, need at least 8)",
             origin, bytes.size());
  const uint64_t hl = safetensors_header_length(bytes.data());
  SPES_CHECK(hl <= kMaxHeaderBytes, "{}: safetensors header length {} exceeds the 100 MB limit",
             origin, hl);
  SPES_CHECK(8 + hl <= bytes.size(), "{}: safetensors header length {} runs past the end of the "
             "data ({} bytes): the file is truncated or not safetensors", origin, hl, bytes.size());
  const SafetensorsHeader h =
      safetensors_header_decode(bytes.data() + 8, hl, bytes.size() - 8 - hl, origin);
  if (metadata)
    for (const auto& [k, v] : h.metadata) (*metadata)[k] = v;
  const char* data = bytes.data() + 8 + hl;
  NamedTensors out;
  out.reserve(h.entries.size());
  for (const auto& e : h.entries) {  // in data order (files written here store tensors in order)
    torch::Tensor t = torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype));
    if (e.end > e.begin) std::memcpy(t.data_ptr(), data + e.begin, e.end - e.begin);
    out.emplace_back(e.name, t);
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
