// Streamed safetensors framing (see framing.h).
#include "spes/sync/wire/framing.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <unordered_map>

#include "spes/common/error.h"
#include "spes/io/files.h"

namespace spes::sync {
namespace fs = std::filesystem;

namespace {
constexpr uint64_t kFileIoBytes = 4ull << 20;
constexpr uint64_t kMaxStreamHeaderForFiles = 100ull << 20;  // the format's own limit
}  // namespace

WireDtype wire_dtype_of(TransferDtype d) {
  return d == TransferDtype::Bf16 ? WireDtype::BF16 : WireDtype::F32;
}

const char* wire_dtype_name(WireDtype d) { return d == WireDtype::BF16 ? "bf16" : "fp32"; }

torch::ScalarType wire_scalar_type(WireDtype d) {
  return d == WireDtype::BF16 ? torch::kBFloat16 : torch::kFloat32;
}

void wire_round_(const torch::Tensor& t, WireDtype d) {
  if (d == WireDtype::F32) return;
  torch::NoGradGuard ng;
  t.copy_(t.to(wire_scalar_type(d)));
}

// ---------------------------------------------------------------------------------------------
SafetensorsStreamWriter::SafetensorsStreamWriter(NamedTensors tensors, torch::ScalarType dtype,
                                                 Metadata metadata) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  for (auto& [name, t] : tensors) {
    shapes.emplace_back(name, t.sizes().vec());
    items_.push_back({t.detach().contiguous().view(-1), 0, 0, 0, dtype});
  }
  build_header(shapes, std::move(metadata));
}

SafetensorsStreamWriter SafetensorsStreamWriter::as_stored(NamedTensors tensors,
                                                           Metadata metadata) {
  SafetensorsStreamWriter w;
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  for (auto& [name, t] : tensors) {
    shapes.emplace_back(name, t.sizes().vec());
    w.items_.push_back({t.detach().contiguous().view(-1), 0, 0, 0, t.scalar_type()});
  }
  w.build_header(shapes, std::move(metadata));
  return w;
}

void SafetensorsStreamWriter::build_header(
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& shapes, Metadata metadata) {
  // Same header as safetensors_serialize: metadata first, tensors in the given order.
  std::vector<SafetensorsEntry> entries;
  for (size_t k = 0; k < shapes.size(); ++k)
    entries.push_back({shapes[k].first, items_[k].dtype, shapes[k].second});
  header_ = safetensors_header_encode(entries, metadata);
  for (size_t k = 0; k < entries.size(); ++k) {
    items_[k].begin = entries[k].begin;
    items_[k].end = entries[k].end;
  }
  data_bytes_ = entries.empty() ? 0 : entries.back().end;
}

SafetensorsStreamWriter SafetensorsStreamWriter::from_file(const std::string& path,
                                                           const std::vector<std::string>& names,
                                                           torch::ScalarType dtype,
                                                           Metadata metadata) {
  return open_file(path, names, dtype, std::move(metadata));
}

SafetensorsStreamWriter SafetensorsStreamWriter::from_file_as_stored(
    const std::string& path, const std::vector<std::string>& names, Metadata metadata) {
  return open_file(path, names, std::nullopt, std::move(metadata));
}

SafetensorsStreamWriter SafetensorsStreamWriter::open_file(const std::string& path,
                                                           const std::vector<std::string>& names,
                                                           std::optional<torch::ScalarType> dtype,
                                                           Metadata metadata) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  SPES_CHECK(fd >= 0, "cannot open '{}' for reading: {}", path, std::strerror(errno));
  SafetensorsStreamWriter w;
  w.fd_ = std::shared_ptr<int>(new int(fd), [](int* p) {
    ::close(*p);
    delete p;
  });
  // The header as read through this descriptor (the file at `path` may be replaced later).
  const StreamHeader h = read_stream_header("/proc/self/fd/" + std::to_string(fd));
  std::unordered_map<std::string, const StreamEntry*> by_name;
  for (const auto& e : h.entries) by_name[e.name] = &e;
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  for (const auto& n : names) {
    auto it = by_name.find(n);
    SPES_CHECK(it != by_name.end(), "'{}' has no tensor '{}'", path, n);
    SPES_CHECK(!dtype || it->second->dtype == torch::kFloat32, "'{}': tensor '{}' is not F32",
               path, n);
    shapes.emplace_back(n, it->second->shape);
    Item item{torch::Tensor(), 0, 0, h.header_bytes + it->second->begin,
              dtype.value_or(it->second->dtype), it->second->dtype};
    w.items_.push_back(item);
  }
  w.build_header(shapes, std::move(metadata));
  return w;
}

void SafetensorsStreamWriter::read(uint64_t offset, uint64_t n, std::string* out) const {
  const uint64_t end = std::min(total_bytes(), offset + n);
  const uint64_t hb = header_.size();
  while (offset < end) {
    if (offset < hb) {
      const uint64_t take = std::min(end, hb) - offset;
      out->append(header_.data() + offset, take);
      offset += take;
      continue;
    }
    const uint64_t d = offset - hb;
    // The item holding data byte d (items are sorted by begin; skip empty ones).
    auto it = std::upper_bound(items_.begin(), items_.end(), d,
                               [](uint64_t v, const Item& i) { return v < i.begin; });
    SPES_CHECK(it != items_.begin() && (it - 1)->end > d,
               "stream writer: internal offset error at data byte {}", d);
    const Item& item = *(it - 1);
    const uint64_t es = c10::elementSize(item.dtype);
    const uint64_t stop = std::min(item.end, end - hb);
    if (fd_ && item.dtype == item.file_dtype) {  // stored as sent: straight into `out`
      const size_t at = out->size();
      out->resize(at + (stop - d));
      file_pread_exact(*fd_, out->data() + at, stop - d, item.file_offset + (d - item.begin),
                       "the stream writer's source file");
      offset = hb + stop;
      continue;
    }
    const int64_t e0 = static_cast<int64_t>((d - item.begin) / es);
    const int64_t e1 = static_cast<int64_t>((stop - item.begin + es - 1) / es);
    torch::Tensor part;
    if (fd_) {  // file source in another dtype: the stored values of elements [e0, e1)
      torch::Tensor raw = torch::empty({e1 - e0}, item.file_dtype);
      const uint64_t fes = c10::elementSize(item.file_dtype);
      file_pread_exact(*fd_, raw.data_ptr(), static_cast<uint64_t>(e1 - e0) * fes,
                       item.file_offset + e0 * fes, "the stream writer's source file");
      part = raw.to(item.dtype).contiguous();  // same dtype: read directly, above
    } else {
      part = item.flat.slice(0, e0, e1).to(torch::kCPU, item.dtype).contiguous();
    }
    const char* p = static_cast<const char*>(part.data_ptr()) + (d - item.begin - e0 * es);
    out->append(p, stop - d);
    offset = hb + stop;
  }
}

// ---------------------------------------------------------------------------------------------
SafetensorsStreamReader::SafetensorsStreamReader(uint64_t total_bytes, std::string origin,
                                                 HeaderFn on_header, TensorFn on_tensor,
                                                 uint64_t max_header_bytes)
    : total_(total_bytes), max_header_(max_header_bytes), origin_(std::move(origin)),
      on_header_(std::move(on_header)), on_tensor_(std::move(on_tensor)) {
  SPES_CHECK(total_ >= 8, "{}: a stream of {} bytes cannot hold a safetensors header", origin_,
             total_);
}

void SafetensorsStreamReader::feed(const char* data, size_t n) {
  SPES_CHECK(consumed_ + n <= total_, "{}: stream is longer than the {} bytes declared", origin_,
             total_);
  while (n > 0) {
    if (parsed_) {
      feed_data(data, n);
      consumed_ += n;
      return;
    }
    uint64_t want = 8;
    if (head_.size() >= 8) {
      want = 8 + safetensors_header_length(head_.data());
    }
    const size_t take = static_cast<size_t>(std::min<uint64_t>(want - head_.size(), n));
    head_.append(data, take);
    data += take;
    n -= take;
    consumed_ += take;
    if (head_.size() == 8) {
      const uint64_t hl = safetensors_header_length(head_.data());
      SPES_CHECK(hl <= max_header_, "{}: safetensors header of {} bytes exceeds the {} byte limit",
                 origin_, hl, max_header_);
      SPES_CHECK(8 + hl <= total_, "{}: safetensors header of {} bytes runs past the end of the "
                 "{}-byte stream", origin_, hl, total_);
      if (hl == 0) parse_header();
    } else if (head_.size() > 8 && head_.size() == want) {
      parse_header();
    }
  }
}

void SafetensorsStreamReader::parse_header() {
  header_ = safetensors_header_decode(head_.data() + 8, head_.size() - 8, total_ - head_.size(),
                                      origin_);
  parsed_ = true;
  head_.clear();
  head_.shrink_to_fit();
  if (on_header_) on_header_(header_);
  feed_data(nullptr, 0);  // hands out leading empty tensors
}

void SafetensorsStreamReader::feed_data(const char* data, size_t n) {
  auto& es = header_.entries;
  for (;;) {
    while (next_ < es.size() && es[next_].begin == es[next_].end) {
      const auto opts = torch::TensorOptions().dtype(es[next_].dtype);
      if (on_slice_) on_slice_(es[next_], 0, torch::empty({0}, opts), true);
      else if (on_tensor_) on_tensor_(es[next_], torch::empty(es[next_].shape, opts));
      ++next_;
    }
    if (n == 0) return;
    SPES_CHECK(next_ < es.size(), "{}: bytes past the last tensor", origin_);
    const StreamEntry& e = es[next_];
    const uint64_t size = e.end - e.begin;
    const size_t take = static_cast<size_t>(std::min<uint64_t>(size - current_fill_, n));
    if (on_slice_) {
      // Whole elements out of (carried partial element + new bytes); the rest is carried.
      const uint64_t esz = c10::elementSize(e.dtype);
      const uint64_t avail = carry_.size() + take;
      const uint64_t whole = avail / esz * esz;
      const int64_t first = static_cast<int64_t>((current_fill_ - carry_.size()) / esz);
      torch::Tensor run = torch::empty({static_cast<int64_t>(whole / esz)},
                                       torch::TensorOptions().dtype(e.dtype));
      char* dst = static_cast<char*>(run.data_ptr());
      if (whole > 0) {
        std::memcpy(dst, carry_.data(), carry_.size());
        std::memcpy(dst + carry_.size(), data, whole - carry_.size());
        carry_.assign(data + (whole - carry_.size()), avail - whole);
      } else {
        carry_.append(data, take);
      }
      current_fill_ += take;
      const bool last = current_fill_ == size;
      if (whole > 0 || last) on_slice_(e, first, run, last);
    } else {
      if (current_fill_ == 0)
        current_ = torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype));
      std::memcpy(static_cast<char*>(current_.data_ptr()) + current_fill_, data, take);
      current_fill_ += take;
    }
    data += take;
    n -= take;
    if (current_fill_ == size) {
      torch::Tensor t = std::move(current_);
      current_ = torch::Tensor();
      current_fill_ = 0;
      carry_.clear();
      ++next_;
      if (!on_slice_ && on_tensor_) on_tensor_(e, t);
    }
  }
}

void SafetensorsStreamReader::finish() const {
  SPES_CHECK(parsed_ && consumed_ == total_, "{}: stream ended after {} of {} bytes", origin_,
             consumed_, total_);
  SPES_CHECK(next_ == header_.entries.size(), "{}: stream ended inside tensor '{}'", origin_,
             next_ < header_.entries.size() ? header_.entries[next_].name : "");
}

// ---------------------------------------------------------------------------------------------
void stream_file(const std::string& path, SafetensorsStreamReader& reader) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  SPES_CHECK(f, "cannot open '{}' for reading", path);
  std::vector<char> buf(4 << 20);
  try {
    for (;;) {
      const size_t n = std::fread(buf.data(), 1, buf.size(), f);
      if (n == 0) break;
      reader.feed(buf.data(), n);
    }
    SPES_CHECK(!std::ferror(f), "error reading '{}'", path);
  } catch (...) {
    std::fclose(f);
    throw;
  }
  std::fclose(f);
  reader.finish();
}

StreamHeader read_stream_header(const std::string& path) {
  const uint64_t size = fs::file_size(path);
  SafetensorsStreamReader r(size, path, nullptr, nullptr, kMaxStreamHeaderForFiles);
  std::FILE* f = std::fopen(path.c_str(), "rb");
  SPES_CHECK(f, "cannot open '{}' for reading", path);
  std::string buf(8, '\0');
  const bool ok = std::fread(&buf[0], 1, 8, f) == 8;
  if (ok) {
    r.feed(buf.data(), 8);
    uint64_t hl = 0;
    for (int i = 0; i < 8; ++i) hl |= static_cast<uint64_t>(static_cast<uint8_t>(buf[i])) << (8 * i);
    buf.assign(hl, '\0');
    if (hl > 0 && std::fread(&buf[0], 1, hl, f) != hl) {
      std::fclose(f);
      fail("{}: truncated safetensors header", path);
    }
    r.feed(buf.data(), hl);
  }
  std::fclose(f);
  SPES_CHECK(ok && r.has_header(), "{}: truncated safetensors header", path);
  return r.header();
}

std::string write_stream_file(const std::string& path, const SafetensorsStreamWriter& writer,
                              bool set_aside_replaced,
                              const std::function<void(std::string* head)>& amend_head) {
  const fs::path p(path);
  if (p.has_parent_path()) fs::create_directories(p.parent_path());
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  uint64_t off = 0;
  try {
    file_write_direct(tmp, [&](std::string* buf) {
      writer.read(off, kFileIoBytes, buf);
      off += buf->size();
    }, amend_head);
  } catch (const std::exception&) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw;
  }
  // The replaced file keeps a temporary name of this process: a restarted server removes it.
  const std::string aside = tmp + ".replaced";
  std::string replaced;
  if (!set_aside_replaced) fs::rename(tmp, path);
  else if (file_replace(tmp, path, aside)) replaced = aside;
  dir_fsync(p.has_parent_path() ? p.parent_path().string() : ".");
  return replaced;
}

bool stream_equals_file(const SafetensorsStreamWriter& writer, const std::string& path) {
  std::error_code ec;
  if (fs::file_size(path, ec) != writer.total_bytes() || ec) return false;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return false;
  std::string want, got(kFileIoBytes, '\0');
  bool same = true;
  for (uint64_t off = 0; off < writer.total_bytes() && same; off += kFileIoBytes) {
    want.clear();
    writer.read(off, kFileIoBytes, &want);
    same = std::fread(&got[0], 1, want.size(), f) == want.size() &&
           std::memcmp(got.data(), want.data(), want.size()) == 0;
  }
  std::fclose(f);
  return same;
}


}  // namespace spes::sync
