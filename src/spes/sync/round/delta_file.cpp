// The published delta's file: streaming writer, record, check (see delta_file.h).
#include "spes/sync/round/delta_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/io/files.h"

namespace spes::sync {
namespace fs = std::filesystem;

namespace {
std::string join_indices(const std::vector<size_t>& v) {
  std::string s;
  for (size_t i : v) s += (s.empty() ? "" : ",") + std::to_string(i);
  return s;
}
}  // namespace

DeltaFileWriter::DeltaFileWriter(const RoundPlan& plan, std::string path,
                                 std::vector<size_t> tensors,
                                 const std::vector<size_t>& owner_candidates, int64_t round,
                                 int64_t from_round)
    : plan_(plan), path_(std::move(path)), tensors_(std::move(tensors)) {
  const Compression c = plan_.compression();
  SPES_CHECK(c != Compression::None, "delta file: no delta without compression (internal)");
  first_entry_.assign(plan_.tensors().size(), -1);
  for (size_t i : tensors_) {
    SPES_CHECK(i < plan_.tensors().size(), "delta file: no tensor {} (internal)", i);
    const PlanTensor& t = plan_.tensors()[i];
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    first_entry_[i] = static_cast<int64_t>(entries_.size());
    if (c == Compression::Int8)
      entries_.push_back({delta_scale_name(t.name), torch::kFloat32, {delta_blocks(numel)}});
    // topk: room for the longest payload (the header reserved below is then the widest).
    entries_.push_back({t.name, delta_wire_dtype(c),
                        c == Compression::Topk
                            ? std::vector<int64_t>{static_cast<int64_t>(
                                  topk_max_bytes(numel, plan_.topk_published()))}
                            : t.shape});
  }
  // The largest header: every candidate exact, digests of their fixed length.
  DeltaRecord widest;
  widest.round = round;
  widest.from_round = from_round;
  widest.model_sha256 = widest.from_sha256 = std::string(64, '0');
  reserved_ = safetensors_header_encode(entries_, metadata(widest, join_indices(owner_candidates)))
                  .size();
  tmp_ = path_ + ".tmp." + std::to_string(::getpid());
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  SPES_CHECK(fd_ >= 0, "cannot create '{}': {}", tmp_, std::strerror(errno));
}

DeltaFileWriter::~DeltaFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_.c_str());
}

Metadata DeltaFileWriter::metadata(const DeltaRecord& r, const std::string& owner_exact) const {
  return {{"format", "spes-delta-v1"},
          {"round", std::to_string(r.round)},
          {"from_round", std::to_string(r.from_round)},
          {"model_sha256", r.model_sha256},
          {"from_sha256", r.from_sha256},
          {"compression", compression_name(plan_.compression())},
          {"owner_exact", owner_exact}};
}

void DeltaFileWriter::pwrite_all(const void* data, uint64_t n, uint64_t offset) {
  const char* p = static_cast<const char*>(data);
  while (n > 0 && error_.empty()) {
    const ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      error_ = fmt::format("cannot write '{}' (disk full?): {}", tmp_,
                           w < 0 ? std::strerror(errno) : "nothing written");
      return;
    }
    p += w;
    n -= static_cast<uint64_t>(w);
    offset += static_cast<uint64_t>(w);
  }
}

void DeltaFileWriter::write(size_t i, int64_t first, int64_t n, const void* q,
                            const float* scales) {
  SPES_CHECK(i < first_entry_.size() && first_entry_[i] >= 0 && first >= 0 && n >= 0,
             "delta file: tensor {} is not part of this delta (internal)", i);
  const bool int8 = plan_.compression() == Compression::Int8;
  const SafetensorsEntry& values = entries_[first_entry_[i] + (int8 ? 1 : 0)];
  const uint64_t es = c10::elementSize(values.dtype);
  SPES_CHECK(values.begin + static_cast<uint64_t>(first + n) * es <= values.end &&
                 (!int8 || first % kDeltaBlock == 0),
             "delta file: values [{}, {}) of '{}' out of place (internal)", first, first + n,
             values.name);
  pwrite_all(q, static_cast<uint64_t>(n) * es,
             reserved_ + values.begin + static_cast<uint64_t>(first) * es);
  if (int8 && n > 0) {
    const SafetensorsEntry& s = entries_[first_entry_[i]];
    pwrite_all(scales, static_cast<uint64_t>(delta_blocks(n)) * 4,
               reserved_ + s.begin + static_cast<uint64_t>(first / kDeltaBlock) * 4);
  }
}

void DeltaFileWriter::write_payload(size_t i, const std::string& payload) {
  SPES_CHECK(plan_.compression() == Compression::Topk && payloads_ < tensors_.size() &&
                 tensors_[payloads_] == i,
             "delta file: payload of tensor {} out of order (internal)", i);
  SafetensorsEntry& e = entries_[first_entry_[i]];
  e.shape = {static_cast<int64_t>(payload.size())};
  pwrite_all(payload.data(), payload.size(), reserved_ + payload_end_);
  payload_end_ += payload.size();
  ++payloads_;
}

void DeltaFileWriter::commit(const DeltaRecord& r) {
  SPES_CHECK(!committed_ && fd_ >= 0, "delta file: '{}' committed twice (internal)", path_);
  SPES_CHECK(r.tensors == tensors_, "delta file: the record's tensors are not the file's "
             "(internal)");
  if (!error_.empty()) fail("{}", error_);
  SPES_CHECK(plan_.compression() != Compression::Topk || payloads_ == tensors_.size(),
             "delta file: {} of {} payloads written (internal)", payloads_, tensors_.size());
  std::vector<SafetensorsEntry> entries = entries_;
  std::string header = safetensors_header_encode(entries, metadata(r, join_indices(r.owner_exact)));
  SPES_CHECK(header.size() <= reserved_, "delta file: header of {} bytes, {} reserved "
             "(internal)", header.size(), reserved_);
  // The JSON padded with spaces to the reserved room; the length prefix says so.
  header.append(reserved_ - header.size(), ' ');
  const uint64_t json = reserved_ - 8;
  for (int k = 0; k < 8; ++k) header[k] = static_cast<char>((json >> (8 * k)) & 0xff);
  pwrite_all(header.data(), header.size(), 0);
  const uint64_t total = reserved_ + (entries.empty() ? 0 : entries.back().end);
  if (error_.empty() && ::ftruncate(fd_, static_cast<off_t>(total)) != 0)
    error_ = fmt::format("cannot size '{}': {}", tmp_, std::strerror(errno));
  if (error_.empty() && ::fsync(fd_) != 0)
    error_ = fmt::format("cannot write '{}' (disk full?): {}", tmp_, std::strerror(errno));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0 && error_.empty())
    error_ = fmt::format("cannot write '{}' (disk full?): {}", tmp_, std::strerror(errno));
  if (!error_.empty()) fail("{}", error_);
  fs::rename(tmp_, path_);
  committed_ = true;
  const fs::path p(path_);
  dir_fsync(p.has_parent_path() ? p.parent_path().string() : ".");
}

namespace {
int64_t parse_index(const std::string& s, const std::string& what, const std::string& origin) {
  try {
    size_t pos = 0;
    const long long v = std::stoll(s, &pos);
    if (pos == s.size() && v >= 0) return v;
  } catch (const std::exception&) {
  }
  sync_fail(SyncErrc::InvalidArgument, "{}: {} '{}' is not a non-negative integer", origin, what,
            printable(s, 40));
}
}  // namespace

DeltaRecord delta_record_of(const RoundPlan& plan, const StreamHeader& h,
                            const std::string& origin) {
  const Metadata& md = h.metadata;
  auto get = [&](const char* key) {
    auto it = md.find(key);
    if (it == md.end())
      sync_fail(SyncErrc::InvalidArgument, "{}: delta metadata lacks '{}'", origin, key);
    return it->second;
  };
  if (get("format") != "spes-delta-v1")
    sync_fail(SyncErrc::InvalidArgument, "{}: not a published delta (format '{}')", origin,
              printable(get("format"), 40));
  if (get("compression") != compression_name(plan.compression()))
    sync_fail(SyncErrc::InvalidArgument, "{}: a {} delta, but spes_config.compression is {}",
              origin, printable(get("compression"), 40), compression_name(plan.compression()));
  DeltaRecord r;
  r.round = parse_index(get("round"), "round", origin);
  r.from_round = parse_index(get("from_round"), "from_round", origin);
  r.model_sha256 = get("model_sha256");
  r.from_sha256 = get("from_sha256");
  for (const StreamEntry& e : delta_tensor_entries(h.entries, plan.compression(), origin)) {
    const int64_t i = plan.index(e.name);
    if (i < 0 ||
        !delta_entry_problem(e, plan.tensors()[i].shape, plan.compression(),
                             plan.topk_published())
             .empty() ||
        (!r.tensors.empty() && static_cast<size_t>(i) <= r.tensors.back()))
      sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}' is not a {} delta of the model in "
                "model order", origin, printable(e.name), compression_name(plan.compression()));
    r.tensors.push_back(static_cast<size_t>(i));
  }
  for (const std::string& s : split(get("owner_exact"), ',')) {
    if (s.empty()) continue;
    const size_t i = static_cast<size_t>(parse_index(s, "owner_exact entry", origin));
    SPES_CHECK(std::binary_search(r.tensors.begin(), r.tensors.end(), i),
               "{}: owner_exact names tensor {}, which the delta does not hold", origin, i);
    r.owner_exact.push_back(i);
  }
  return r;
}

bool delta_file_holds(const std::string& path, const DeltaRecord& r) {
  try {
    const StreamHeader h = read_stream_header(path);
    auto is = [&](const char* key, const std::string& want) {
      auto it = h.metadata.find(key);
      return it != h.metadata.end() && it->second == want;
    };
    return is("format", "spes-delta-v1") && is("round", std::to_string(r.round)) &&
           is("from_round", std::to_string(r.from_round)) &&
           is("model_sha256", r.model_sha256);
  } catch (const std::exception&) {
    return false;
  }
}

std::vector<std::string> delta_download_names(const RoundPlan& plan, const DeltaRecord& r,
                                               int64_t node, bool used) {
  std::vector<std::string> names;
  for (size_t i : r.tensors) {
    const PlanTensor& t = plan.tensors()[i];
    // The owner already holds this expert's published value: its own rebuilt upload.
    if (used && t.owner == node &&
        std::find(r.owner_exact.begin(), r.owner_exact.end(), i) != r.owner_exact.end())
      continue;
    if (plan.compression() == Compression::Int8) names.push_back(delta_scale_name(t.name));
    names.push_back(t.name);
  }
  return names;
}

}  // namespace spes::sync
