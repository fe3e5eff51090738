// The published model of a compressed run and its delta from the previous round, computed
// piece by piece (see published_delta.h).
#include "spes/sync/round/published_delta.h"

#include <algorithm>
#include <cstring>

#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/io/files.h"
#include "spes/sync/wire/topk_codec.h"

namespace spes::sync {

bool round_may_change(const PlanTensor& t, bool merged) {
  return !t.uploaders.empty() || (merged && t.role == ParamRole::Expert);
}

PublishedDelta delta_layout(const RoundPlan& plan, const RoundOutcome& outcome) {
  PublishedDelta d;
  for (size_t i = 0; i < plan.tensors().size(); ++i)
    if (round_may_change(plan.tensors()[i], outcome.merged)) d.tensors.push_back(i);
  // Merging changed the experts after their owners' uploads: their q no longer describes them.
  if (!outcome.merged)
    for (const auto& kv : outcome.owner_deltas) d.owner_exact.push_back(kv.first);
  return d;
}

PublicationQuantiser::PublicationQuantiser(SyncModel& model, RoundOutcome& outcome,
                                           DeltaFileWriter* file)
    : model_(model), merged_(outcome.merged), file_(file) {
  if (!merged_) owner_ = std::move(outcome.owner_deltas);
  outcome.owner_deltas.clear();
  const auto& ts = model_.plan().tensors();
  done_.assign(ts.size(), false);
  exact_.assign(ts.size(), false);
  for (const auto& t : ts) wanted_.push_back(round_may_change(t, merged_));
}

bool PublicationQuantiser::wants(size_t i) const {
  return i < wanted_.size() && wanted_[i] && !done_[i];
}

bool PublicationQuantiser::owner_exact(size_t i, const StagedDelta& own,
                                       const PrevReader& read_prev) {
  const Compression c = model_.plan().compression();
  const torch::Tensor& agg = model_.tensors()[i];
  const int64_t n = agg.numel();
  const float* out = agg.data_ptr<float>();
  const uint64_t es = c == Compression::Int8 ? 1 : 2;
  const ReadFile file = ReadFile::try_open(own.file);
  if (!file) return false;
  const int fd = file.fd();
  try {
    for (int64_t first = 0; first < n; first += kPieceValues) {
      const int64_t m = std::min(kPieceValues, n - first);
      read_prev(first, m, prev_.data());
      file_pread_exact(fd, q_.data(), static_cast<uint64_t>(m) * es,
                       own.q_at + static_cast<uint64_t>(first) * es, "'" + own.file + "'");
      if (c == Compression::Int8) {
        file_pread_exact(fd, scales_.data(), static_cast<uint64_t>(delta_blocks(m)) * 4,
                         own.scales_at + static_cast<uint64_t>(first / kDeltaBlock) * 4,
                         "'" + own.file + "'");
        delta_rebuild_int8(prev_.data(), reinterpret_cast<const int8_t*>(q_.data()),
                           scales_.data(), 0, m, work_.data());
      } else {
        delta_rebuild_bf16(prev_.data(), reinterpret_cast<const uint16_t*>(q_.data()), m,
                           work_.data());
      }
      if (std::memcmp(work_.data(), out + first, static_cast<size_t>(m) * 4) != 0) return false;
      if (file_) file_->write(i, first, m, q_.data(), scales_.data());
    }
  } catch (const std::exception&) {
    return false;  // unreadable: D is computed from the values instead
  }
  return true;
}

bool PublicationQuantiser::topk_owner_exact(size_t i, const StagedDelta& own,
                                            const torch::Tensor& prev, std::string* payload) {
  const RoundPlan& plan = model_.plan();
  const torch::Tensor& agg = model_.tensors()[i];
  const ReadFile file = ReadFile::try_open(own.file);
  if (!file || own.bytes == 0) return false;
  try {
    payload->assign(own.bytes, '\0');
    file_pread_exact(file.fd(), payload->data(), own.bytes, own.q_at, "'" + own.file + "'");
    const TopkSparse s = topk_decode_checked(*payload, agg.numel(), plan.topk(),
                                             plan.tensors()[i].name, own.file);
    const torch::Tensor u = topk_rebuild_tensor(prev, s);
    return std::memcmp(u.data_ptr<float>(), agg.data_ptr<float>(),
                       static_cast<size_t>(agg.numel()) * 4) == 0;
  } catch (const std::exception&) {
    return false;  // unreadable: D is computed from the values instead
  }
}

void PublicationQuantiser::topk_tensor(size_t i, const PrevReader& read_prev) {
  const std::string& name = model_.plan().tensors()[i].name;
  SparsePublisher* pub = model_.sparse();
  SPES_CHECK(pub, "publication: topk without its publisher (internal)");
  torch::Tensor agg = model_.tensors()[i];
  const int64_t n = agg.numel();
  torch::Tensor prev = torch::empty({n}, torch::kFloat32);
  for (int64_t first = 0; first < n; first += kPieceValues)
    read_prev(first, std::min(kPieceValues, n - first), prev.data_ptr<float>() + first);
  std::string payload;
  auto own = owner_.find(i);
  if (own != owner_.end()) {
    const bool exact = topk_owner_exact(i, own->second, prev, &payload);
    owner_.erase(own);
    if (exact) {
      pub->publish_exact(i);
      exact_[i] = true;
      if (file_) file_->write_payload(i, payload);
      return;
    }
  }
  payload = pub->publish(i, prev, agg, name);
  if (file_) file_->write_payload(i, payload);
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
  const size_t piece = static_cast<size_t>(kPieceValues);
  if (prev_.size() < piece) {
    prev_.resize(piece);
    work_.resize(piece);
    scales_.resize(static_cast<size_t>(delta_blocks(kPieceValues)));
    q_.resize(piece * 2);
  }
  done_[i] = true;
  if (c == Compression::Topk) return topk_tensor(i, read_prev);
  // An owner copy is its owner's rebuilt upload P_prev + deq(q): that q is D, exactly (checked).
  auto own = owner_.find(i);
  if (own != owner_.end()) {
    const bool exact = owner_exact(i, own->second, read_prev);
    owner_.erase(own);
    if (exact) {
      exact_[i] = true;
      return;
    }
  }
  // D = Q(P_agg - P_prev) and P_new = P_prev + deq(D), piece by piece (pieces are whole blocks).
  for (int64_t first = 0; first < n; first += kPieceValues) {
    const int64_t m = std::min(kPieceValues, n - first);
    read_prev(first, m, prev_.data());
    for (int64_t k = 0; k < m; ++k) work_[k] = out[first + k] - prev_[k];
    int64_t bad;
    if (c == Compression::Int8) {
      int8_t* q8 = reinterpret_cast<int8_t*>(q_.data());
      bad = delta_quantise_int8(work_.data(), m, q8, scales_.data());
      if (bad < 0) delta_rebuild_int8(prev_.data(), q8, scales_.data(), 0, m, out + first);
    } else {
      uint16_t* q16 = reinterpret_cast<uint16_t*>(q_.data());
      bad = delta_quantise_bf16(work_.data(), m, q16);
      if (bad < 0) delta_rebuild_bf16(prev_.data(), q16, m, out + first);
    }
    SPES_CHECK(bad < 0, "publication: tensor '{}': the change from the previous round is {} at "
               "element {}, which a {} delta cannot carry", name, work_[bad], first + bad,
               compression_name(c));
    if (file_) file_->write(i, first, m, q_.data(), scales_.data());
  }
}

PublishedDelta PublicationQuantiser::finish() {
  PublishedDelta d;
  for (size_t i = 0; i < wanted_.size(); ++i) {
    SPES_CHECK(!wanted_[i] || done_[i], "publication: no previous value was given for "
               "'{}' (internal)", model_.plan().tensors()[i].name);
    if (!wanted_[i]) continue;
    d.tensors.push_back(i);
    if (exact_[i]) d.owner_exact.push_back(i);
  }
  return d;
}

PublishedDelta quantise_publication(SyncModel& model, RoundOutcome& outcome,
                                    const std::string& prev_file, DeltaFileWriter* file) {
  PublicationQuantiser pq(model, outcome, file);
  const RoundPlan& plan = model.plan();
  const StreamHeader h = read_stream_header(prev_file);
  const ReadFile prev = ReadFile::open(prev_file);
  const int fd = prev.fd();
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
                                    const std::vector<torch::Tensor>& prev,
                                    DeltaFileWriter* file) {
  PublicationQuantiser pq(model, outcome, file);
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

}  // namespace spes::sync
