// The published model of a compressed run and its delta from the previous round (see
// published_delta.h).
#include "spes/sync/round/published_delta.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/io/files.h"

namespace spes::sync {

bool round_may_change(const PlanTensor& t, bool merged) {
  return !t.uploaders.empty() || (merged && t.role == ParamRole::Expert);
}

PublicationQuantiser::PublicationQuantiser(SyncModel& model, RoundOutcome& outcome)
    : model_(model), merged_(outcome.merged) {
  // Merging changed the experts after their owners' uploads: their q no longer describes them.
  if (!merged_) owner_ = std::move(outcome.owner_deltas);
  outcome.owner_deltas.clear();
  const auto& ts = model_.plan().tensors();
  q_.resize(ts.size());
  exact_.assign(ts.size(), false);
  for (const auto& t : ts) wanted_.push_back(round_may_change(t, merged_));
}

bool PublicationQuantiser::wants(size_t i) const {
  return i < wanted_.size() && wanted_[i] && !q_[i].q.defined();
}

void PublicationQuantiser::tensor(size_t i, const PrevReader& read_prev) {
  const RoundPlan& plan = model_.plan();
  SPES_CHECK(wants(i), "publication: tensor {} is not expected (internal)", i);
  const Compression c = plan.compression();
  const std::string& name = plan.tensors()[i].name;
  const torch::Tensor& agg = model_.tensors()[i];
  SPES_CHECK(agg.is_contiguous() && agg.device().is_cpu() &&
                 agg.scalar_type() == torch::kFloat32,
             "publication: '{}' must be contiguous fp32 on CPU (internal)", name);
  const int64_t n = agg.numel();
  float* out = agg.data_ptr<float>();
  std::vector<float> prev(static_cast<size_t>(std::min(n, kPieceValues)));
  std::vector<float> work(prev.size());
  // An owner copy is its owner's rebuilt upload P_prev + deq(q): that q is D, exactly (checked).
  auto own = owner_.find(i);
  if (own != owner_.end()) {
    const EncodedDelta& o = own->second;
    bool exact = o.q.defined() && o.q.numel() == n &&
                 (c != Compression::Int8 ||
                  (o.scales.defined() && o.scales.numel() == delta_blocks(n)));
    for (int64_t first = 0; exact && first < n; first += kPieceValues) {
      const int64_t m = std::min(kPieceValues, n - first);
      read_prev(first, m, prev.data());
      if (c == Compression::Int8)
        delta_rebuild_int8(prev.data(), o.q.data_ptr<int8_t>() + first,
                           o.scales.data_ptr<float>(), first, m, work.data());
      else
        delta_rebuild_bf16(prev.data(), static_cast<const uint16_t*>(o.q.data_ptr()) + first, m,
                           work.data());
      exact = std::memcmp(work.data(), out + first, static_cast<size_t>(m) * 4) == 0;
    }
    if (exact) {
      q_[i] = {o.q.view(agg.sizes()), o.scales};
      exact_[i] = true;
      owner_.erase(own);
      return;
    }
  }
  // D = Q(P_agg - P_prev) and P_new = P_prev + deq(D), piece by piece (pieces are whole blocks).
  EncodedDelta q;
  q.q = torch::empty(agg.sizes(), delta_wire_dtype(c));
  if (c == Compression::Int8) q.scales = torch::empty({delta_blocks(n)}, torch::kFloat32);
  for (int64_t first = 0; first < n; first += kPieceValues) {
    const int64_t m = std::min(kPieceValues, n - first);
    read_prev(first, m, prev.data());
    for (int64_t k = 0; k < m; ++k) work[k] = out[first + k] - prev[k];
    int64_t bad;
    if (c == Compression::Int8) {
      bad = delta_quantise_int8(work.data(), m, q.q.data_ptr<int8_t>() + first,
                                q.scales.data_ptr<float>() + first / kDeltaBlock);
      if (bad < 0)
        delta_rebuild_int8(prev.data(), q.q.data_ptr<int8_t>() + first,
                           q.scales.data_ptr<float>(), first, m, out + first);
    } else {
      uint16_t* q16 = static_cast<uint16_t*>(q.q.data_ptr()) + first;
      bad = delta_quantise_bf16(work.data(), m, q16);
      if (bad < 0) delta_rebuild_bf16(prev.data(), q16, m, out + first);
    }
    SPES_CHECK(bad < 0, "publication: tensor '{}': the change from the previous round is {} at "
               "element {}, which a {} delta cannot carry", name, work[bad], first + bad,
               compression_name(c));
  }
  q_[i] = std::move(q);
}

PublishedDelta PublicationQuantiser::finish() {
  PublishedDelta d;
  for (size_t i = 0; i < q_.size(); ++i) {
    SPES_CHECK(!wanted_[i] || q_[i].q.defined(), "publication: no previous value was given for "
               "'{}' (internal)", model_.plan().tensors()[i].name);
    if (!wanted_[i]) continue;
    d.tensors.push_back(i);
    d.q.push_back(std::move(q_[i]));
    if (exact_[i]) d.owner_exact.push_back(i);
  }
  q_.clear();
  return d;
}

PublishedDelta quantise_publication(SyncModel& model, RoundOutcome& outcome,
                                    const std::string& prev_file) {
  PublicationQuantiser pq(model, outcome);
  const RoundPlan& plan = model.plan();
  const StreamHeader h = read_stream_header(prev_file);
  const int fd = ::open(prev_file.c_str(), O_RDONLY | O_CLOEXEC);
  SPES_CHECK(fd >= 0, "cannot open '{}' for reading: {}", prev_file, std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  for (const auto& e : h.entries) {
    const int64_t i = plan.index(e.name);
    SPES_CHECK(i >= 0 && e.shape == plan.tensors()[i].shape && e.dtype == torch::kFloat32,
               "'{}': tensor '{}' does not match the model", prev_file, printable(e.name));
    if (!pq.wants(static_cast<size_t>(i))) continue;
    const uint64_t base = h.header_bytes + e.begin;
    pq.tensor(static_cast<size_t>(i), [&](int64_t first, int64_t n, float* out) {
      file_pread_exact(fd, out, static_cast<uint64_t>(n) * 4,
                       base + static_cast<uint64_t>(first) * 4, "'" + prev_file + "'");
    });
  }
  return pq.finish();
}

PublishedDelta quantise_publication(SyncModel& model, RoundOutcome& outcome,
                                    const std::vector<torch::Tensor>& prev) {
  PublicationQuantiser pq(model, outcome);
  SPES_CHECK(prev.size() == model.tensors().size(), "publication: {} previous tensors for a "
             "model of {}", prev.size(), model.tensors().size());
  for (size_t i = 0; i < prev.size(); ++i) {
    if (!pq.wants(i)) continue;
    const torch::Tensor p = prev[i].to(torch::kCPU, torch::kFloat32).contiguous();
    SPES_CHECK(p.numel() == model.tensors()[i].numel(), "publication: previous tensor {} has "
               "{} values, not {}", i, p.numel(), model.tensors()[i].numel());
    pq.tensor(i, [&](int64_t first, int64_t n, float* out) {
      std::memcpy(out, p.data_ptr<float>() + first, static_cast<size_t>(n) * 4);
    });
  }
  return pq.finish();
}

SafetensorsStreamWriter delta_file_writer(const RoundPlan& plan, const PublishedDelta& d,
                                          const DeltaRecord& r) {
  NamedTensors parts;
  for (size_t k = 0; k < d.tensors.size(); ++k) {
    const std::string& name = plan.tensors()[d.tensors[k]].name;
    if (plan.compression() == Compression::Int8)
      parts.emplace_back(delta_scale_name(name), d.q[k].scales);
    parts.emplace_back(name, d.q[k].q);
  }
  std::string exact;
  for (size_t i : d.owner_exact) exact += (exact.empty() ? "" : ",") + std::to_string(i);
  return SafetensorsStreamWriter::as_stored(
      std::move(parts), {{"format", "spes-delta-v1"},
                         {"round", std::to_string(r.round)},
                         {"from_round", std::to_string(r.from_round)},
                         {"model_sha256", r.model_sha256},
                         {"from_sha256", r.from_sha256},
                         {"compression", compression_name(plan.compression())},
                         {"owner_exact", exact}});
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
  const torch::ScalarType dtype = delta_wire_dtype(plan.compression());
  for (const StreamEntry& e : delta_tensor_entries(h.entries, plan.compression(), origin)) {
    const int64_t i = plan.index(e.name);
    if (i < 0 || e.shape != plan.tensors()[i].shape || e.dtype != dtype ||
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
