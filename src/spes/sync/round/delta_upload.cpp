// A node's compressed uploads: base, error feedback and the rebuilt tensors (see
// delta_upload.h).
#include "spes/sync/round/delta_upload.h"

#include <fmt/ranges.h>

#include <algorithm>

#include "spes/common/error.h"
#include "spes/sync/wire/topk_codec.h"

namespace spes::sync {

namespace {
constexpr const char* kBase = "base/";
constexpr const char* kResidual = "residual/";
}  // namespace

void DeltaUpload::set_base(const ParamRegistry& reg, bool reset_residual, int64_t round,
                           const std::string& model_sha256) {
  torch::NoGradGuard ng;
  base_.clear();
  base_index_.clear();
  for (const auto& e : reg.entries())
    if (e.trainable) {
      base_index_[e.name] = base_.size();
      base_.push_back(e.tensor.detach().to(torch::kCPU, torch::kFloat32, false, true).contiguous());
    }
  if (c_ == Compression::Topk) {
    if (reset_residual || topk_.size() != base_.size()) topk_.reset(base_.size());
  } else if (reset_residual || residual_.size() != base_.size()) {
    residual_.clear();
    for (const auto& b : base_) residual_.push_back(torch::zeros_like(b));
  }
  sent_.clear();
  sent_topk_.clear();
  keep_saved(round, model_sha256);
}

void DeltaUpload::keep_saved(int64_t round, const std::string& model_sha256) {
  std::lock_guard<std::mutex> lk(saved_mu_);
  saved_round_ = round;
  saved_sha_ = model_sha256;
  saved_names_.assign(base_.size(), std::string());
  for (const auto& [name, k] : base_index_) saved_names_.at(k) = name;
  saved_base_ = base_;
  saved_residual_ = c_ == Compression::Topk ? topk_.state() : residual_;
}

DeltaUpload::SavedState DeltaUpload::saved_state() const {
  std::lock_guard<std::mutex> lk(saved_mu_);
  SavedState s{saved_round_, saved_sha_, {}};
  for (size_t k = 0; k < saved_base_.size(); ++k)
    s.tensors.emplace_back(kBase + saved_names_[k], saved_base_[k]);
  for (size_t k = 0; k < saved_residual_.size() && k < saved_names_.size(); ++k)
    if (saved_residual_[k].defined())  // topk: not encoded yet
      s.tensors.emplace_back(kResidual + saved_names_[k], saved_residual_[k]);
  return s;
}

void DeltaUpload::restore_state(const ParamRegistry& reg, const SavedState& s) {
  // Every check before anything changes.
  std::unordered_map<std::string, torch::Tensor> base, residual;
  for (const auto& [key, t] : s.tensors) {
    const bool is_base = key.rfind(kBase, 0) == 0, is_residual = key.rfind(kResidual, 0) == 0;
    SPES_CHECK(is_base || is_residual, "tensor '{}' is neither {}<name> nor {}<name>", key, kBase,
               kResidual);
    const std::string name = key.substr(is_base ? std::string(kBase).size()
                                                : std::string(kResidual).size());
    const RegistryEntry* e = reg.find(name);
    SPES_CHECK(e && e->trainable, "tensor '{}' names no trainable tensor of this model", key);
    SPES_CHECK(t.sizes() == e->tensor.sizes(), "tensor '{}' has shape [{}], the model's '{}' "
               "[{}]", key, fmt::join(t.sizes(), ", "), name, fmt::join(e->tensor.sizes(), ", "));
    SPES_CHECK(t.scalar_type() == torch::kFloat32, "tensor '{}' is {}, not F32", key,
               c10::toString(t.scalar_type()));
    SPES_CHECK(torch::isfinite(t).all().item<bool>(), "tensor '{}' holds NaN or Inf values", key);
    (is_base ? base : residual)[name] = t;
  }
  for (const auto& e : reg.entries()) {
    if (!e.trainable) continue;
    SPES_CHECK(base.count(e.name), "tensor '{}{}' is missing", kBase, e.name);
    SPES_CHECK(c_ == Compression::Topk || residual.count(e.name), "tensor '{}{}' is missing",
               kResidual, e.name);
  }
  base_.clear();
  base_index_.clear();
  std::vector<torch::Tensor> res;
  for (const auto& e : reg.entries())
    if (e.trainable) {
      base_index_[e.name] = base_.size();
      base_.push_back(base.at(e.name).contiguous());
      auto it = residual.find(e.name);
      res.push_back(it == residual.end() ? torch::Tensor() : it->second.contiguous());
    }
  if (c_ == Compression::Topk)
    topk_.restore(std::move(res));
  else
    residual_ = std::move(res);
  sent_.clear();
  sent_topk_.clear();
  keep_saved(s.round, s.model_sha256);
}

std::vector<std::string> DeltaUpload::change_trainable_set(const ParamRegistry& reg,
                                                         const ParamRegistry& published) {
  torch::NoGradGuard ng;
  const bool topk = c_ == Compression::Topk;
  std::vector<torch::Tensor> base, residual;
  std::unordered_map<std::string, size_t> index;
  for (const auto& e : reg.entries()) {
    if (!e.trainable) continue;
    const auto it = base_index_.find(e.name);
    index[e.name] = base.size();
    if (it != base_index_.end()) {
      base.push_back(base_[it->second]);
      residual.push_back(topk ? topk_.held(it->second) : residual_[it->second]);
      continue;
    }
    const RegistryEntry* p = published.find(e.name);
    SPES_CHECK(p, "node: the published model lacks '{}' (internal)", e.name);
    base.push_back(p->tensor.detach().to(torch::kCPU, torch::kFloat32, false, true).contiguous());
    residual.push_back(topk ? torch::Tensor() : torch::zeros_like(base.back()));  // topk: none held
  }
  std::vector<std::string> dropped;
  for (const auto& [name, k] : base_index_)
    if (!index.count(name)) dropped.push_back(name);
  std::sort(dropped.begin(), dropped.end());
  base_ = std::move(base);
  base_index_ = std::move(index);
  if (topk)
    topk_.restore(std::move(residual));
  else
    residual_ = std::move(residual);
  sent_.clear();
  sent_topk_.clear();
  return dropped;
}

SafetensorsStreamWriter DeltaUpload::encode_topk(const ParamRegistry& reg, const UploadMeta& meta) {
  torch::NoGradGuard ng;
  NamedTensors out;
  std::vector<std::string> sent;
  const std::vector<torch::Tensor> before = topk_.state();  // encode() replaces, never mutates
  try {
    size_t k = 0;
    for (const auto& e : reg.entries()) {
      if (!e.trainable) continue;
      SPES_CHECK(k < base_.size(), "node: no base model for its compressed upload (internal)");
      const torch::Tensor w = e.tensor.detach().to(torch::kCPU, torch::kFloat32).contiguous();
      torch::Tensor change = w - base_[k];
      // The weights hold base + a (add_unsent): the round's own change is W - base - a.
      if (unsent_in_weights_ && topk_.held(k).defined()) change -= topk_.held(k).view(change.sizes());
      TopkEncoded q = topk_.encode(k, change, e.name);
      out.emplace_back(e.name, topk_payload_tensor(q.payload));
      sent.push_back(std::move(q.payload));
      ++k;
    }
  } catch (...) {
    topk_.restore(before);  // only a complete encode changes the node's state
    throw;
  }
  sent_topk_ = std::move(sent);
  UploadMeta m = meta;
  m.compression = c_;
  return SafetensorsStreamWriter::as_stored(std::move(out), upload_metadata(m));
}

SafetensorsStreamWriter DeltaUpload::encode(const ParamRegistry& reg, const UploadMeta& meta) {
  SPES_CHECK(enabled(), "DeltaUpload::encode without compression");
  if (c_ == Compression::Topk) return encode_topk(reg, meta);
  torch::NoGradGuard ng;
  NamedTensors out;
  std::vector<EncodedDelta> sent;
  std::vector<torch::Tensor> residual;
  size_t k = 0;
  for (const auto& e : reg.entries()) {
    if (!e.trainable) continue;
    SPES_CHECK(k < base_.size(), "node: no base model for its compressed upload (internal)");
    const torch::Tensor w = e.tensor.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    const torch::Tensor d = (w - base_[k]) + residual_[k];
    EncodedDelta q = delta_encode(d, c_, e.name);
    residual.push_back(d - delta_rebuild(torch::Tensor(), q, c_).view(d.sizes()));
    if (c_ == Compression::Int8) out.emplace_back(delta_scale_name(e.name), q.scales);
    out.emplace_back(e.name, q.q);
    sent.push_back(std::move(q));
    ++k;
  }
  // Only a complete encode changes the node's state (a throw above leaves it as it was).
  residual_ = std::move(residual);
  sent_ = std::move(sent);
  UploadMeta m = meta;
  m.compression = c_;
  return SafetensorsStreamWriter::as_stored(std::move(out), upload_metadata(m));
}

void DeltaUpload::apply_rebuilt(const ParamRegistry& reg) const {
  torch::NoGradGuard ng;
  size_t k = 0;
  for (const auto& e : reg.entries()) {
    if (!e.trainable) continue;
    if (c_ == Compression::Topk) {
      SPES_CHECK(k < sent_topk_.size(), "node: no compressed upload to apply (internal)");
      const TopkSparse sp = topk_decode_checked(sent_topk_[k], base_[k].numel(), topk_params(),
                                                e.name, "the node's own upload");
      e.tensor.detach().copy_(topk_rebuild_tensor(base_[k], sp).view(e.tensor.sizes()));
      ++k;
      continue;
    }
    SPES_CHECK(k < sent_.size(), "node: no compressed upload to apply (internal)");
    e.tensor.detach().copy_(delta_rebuild(base_[k], sent_[k], c_).view(e.tensor.sizes()));
    ++k;
  }
}

void DeltaUpload::add_unsent(const ParamRegistry& reg) const {
  if (!unsent_in_weights_) return;
  torch::NoGradGuard ng;
  size_t k = 0;
  for (const auto& e : reg.entries()) {
    if (!e.trainable) continue;
    SPES_CHECK(k < base_.size(), "node: no base model for its unsent change (internal)");
    const torch::Tensor& a = topk_.held(k++);
    if (!a.defined()) continue;
    const torch::Tensor w = e.tensor.detach();
    w.add_(a.to(w.device(), w.scalar_type()).view(w.sizes()));
  }
}

uint64_t DeltaUpload::upload_data_bytes(const ParamRegistry& reg) const {
  uint64_t n = 0;
  if (c_ == Compression::Topk) {  // the payloads of the last upload (their size varies)
    for (const auto& p : sent_topk_) n += p.size();
    return n;
  }
  for (const auto& e : reg.entries())
    if (e.trainable) n += delta_payload_bytes(c_, e.tensor.numel());
  return n;
}

torch::Tensor DeltaUpload::base(const std::string& name) const {
  auto it = base_index_.find(name);
  return it == base_index_.end() ? torch::Tensor() : base_[it->second];
}

double DeltaUpload::residual_sq() const {
  if (c_ == Compression::Topk) return topk_.held_sq();
  double s = 0;
  for (const auto& r : residual_) s += r.pow(2).sum().item<double>();
  return s;
}

}  // namespace spes::sync
