// One round's arithmetic (see aggregate.h).
#include "spes/sync/round/aggregate.h"
#include "spes/sync/round/published_delta.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <unordered_map>

#include "spes/common/error.h"
#include "spes/io/files.h"
#include "spes/model/ownership.h"
#include "spes/sync/round/change_kernels.h"
#include "spes/sync/round/round_clock.h"
#include "spes/sync/wire/delta_kernels.h"
#include "spes/sync/wire/protocol.h"
#include "spes/train/checkpoint.h"

namespace spes::sync {
namespace fs = std::filesystem;

namespace {
// Coordinate-wise median (the mean of the two middle values for an even count) or trimmed
// mean (dropping floor(trim x n) values at each end) of the nodes' values of one tensor.
torch::Tensor robust_combine(const std::vector<torch::Tensor>& values,
                             Aggregation statistic, double trim) {
  const int64_t n = static_cast<int64_t>(values.size());
  if (n == 1) return values[0];
  const torch::Tensor sorted = std::get<0>(torch::stack(values).sort(0));
  if (statistic == Aggregation::Median) {
    if (n % 2 == 1) return sorted[n / 2].clone();
    return (sorted[n / 2 - 1] + sorted[n / 2]).mul_(0.5);
  }
  const int64_t k = static_cast<int64_t>(std::floor(trim * static_cast<double>(n)));
  return sorted.slice(0, k, n - k).mean(0);
}

// The sections of a staged upload without compression (checked as it arrived) that `wanted`
// selects, in file order, a piece of up to 64K values at a time (small enough to stay in the
// core's cache while the caller uses it), widened to fp32 (bf16 by the delta kernels' exact
// conversion): piece(model index, entry, first value, values, count, last piece of the tensor).
void read_sections(const RoundPlan& plan, const std::string& path, const StreamHeader& h,
                   const std::function<bool(const PlanTensor&)>& wanted,
                   const std::function<void(int64_t, const StreamEntry&, int64_t, float*,
                                            int64_t, bool)>& piece) {
  const ReadFile file = ReadFile::open(path);
  constexpr int64_t kPieceValues = 1 << 16;
  std::vector<float> vals(static_cast<size_t>(kPieceValues));
  std::vector<uint16_t> bf16(static_cast<size_t>(kPieceValues));
  for (const StreamEntry& e : h.entries) {
    const int64_t i = plan.index(e.name);
    SPES_CHECK(i >= 0, "{}: tensor '{}' is not part of the model", path, e.name);
    const PlanTensor& t = plan.tensors()[static_cast<size_t>(i)];
    if (!wanted(t)) continue;
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    const int64_t elem = e.dtype == torch::kFloat32 ? 4 : e.dtype == torch::kBFloat16 ? 2 : 0;
    SPES_CHECK(elem > 0 && e.end - e.begin == static_cast<uint64_t>(n * elem),
               "{}: tensor '{}' ({} bytes) does not match the model's {} values", path, e.name,
               e.end - e.begin, n);
    for (int64_t k0 = 0; k0 < n; k0 += kPieceValues) {
      const int64_t m = std::min(kPieceValues, n - k0);
      const uint64_t at = h.header_bytes + e.begin + static_cast<uint64_t>(k0 * elem);
      if (elem == 4) {
        file_pread_exact(file.fd(), vals.data(), static_cast<uint64_t>(m) * 4, at, path);
      } else {
        file_pread_exact(file.fd(), bf16.data(), static_cast<uint64_t>(m) * 2, at, path);
        delta_rebuild_bf16(nullptr, bf16.data(), m, vals.data());
      }
      piece(i, e, k0, vals.data(), m, k0 + m == n);
    }
  }
}

// An uncompressed upload's owner-copied tensors, straight from its staged file into the
// published tensors (the upload's other tensors were folded as it arrived), ||new - old||^2
// summed in the copy loop (into change[i]).
void copy_owner_sections(const RoundPlan& plan, int64_t node, const std::string& path,
                         const std::vector<torch::Tensor>& pub, std::vector<double>& change) {
  read_sections(
      plan, path, read_stream_header(path),
      [&](const PlanTensor& t) { return t.rule == Combine::OwnerCopy && t.owner == node; },
      [&](int64_t i, const StreamEntry& e, int64_t first, float* v, int64_t m, bool) {
        const torch::Tensor& p = pub[static_cast<size_t>(i)];
        SPES_CHECK(p.is_contiguous() && p.scalar_type() == torch::kFloat32 &&
                       first + m <= p.numel(),
                   "{}: tensor '{}' does not match the published tensor", path, e.name);
        change[static_cast<size_t>(i)] +=
            copy_with_squared_change(v, p.data_ptr<float>() + first, m);
      });
}
}  // namespace

SyncModel::SyncModel(const Config& cfg, std::optional<InitialWeights> initial) : cfg_(cfg) {
  model_ = std::make_unique<Transformer>(cfg_.model, torch::kCPU);
  model_->init_weights(static_cast<uint64_t>(cfg_.seed), initial ? &*initial : nullptr);
  initial.reset();  // the model holds its own copy
  const Ownership ownership = Ownership::from_config(cfg_);
  ownership_fingerprint_ = ownership.fingerprint();
  registry_ = std::make_unique<ParamRegistry>(*model_, cfg_, ownership, /*node_id=*/-1);
  plan_ = std::make_unique<RoundPlan>(cfg_, *model_);  // also clears requires_grad
  for (const auto& p : model_->params()) tensors_.push_back(p.tensor);
  momentum_.resize(tensors_.size());
  if (plan_->compression() == Compression::Topk)
    sparse_ = std::make_unique<SparsePublisher>(plan_->topk_published(), tensors_.size());
  // The published model is what nodes receive: values representable in the transfer dtype.
  for (const auto& t : tensors_) wire_round_(t, plan_->wire());
}

SyncModel::~SyncModel() = default;

void SyncModel::change_ownership(const Ownership& ownership, int64_t epoch) {
  RoundPlan next(cfg_, *model_, ownership, epoch);
  published_plan_ = std::make_unique<RoundPlan>(std::move(*plan_));
  *plan_ = std::move(next);
}

NamedTensors SyncModel::named() const {
  NamedTensors out;
  for (size_t i = 0; i < tensors_.size(); ++i)
    out.emplace_back(plan_->tensors()[i].name, tensors_[i]);
  return out;
}

void SyncModel::load(const NamedTensors& tensors, const std::string& origin) {
  registry_load_tensors(*registry_, tensors, /*require_all=*/true, origin);
}

std::string SyncModel::weights_sha256() const { return registry_->weights_sha256(); }
std::string SyncModel::flat_weights_sha256() const { return registry_->flat_weights_sha256(); }
std::string SyncModel::model_fingerprint() const { return registry_->fingerprint(); }

void SyncModel::save_sparse_residual(const std::string& path, int64_t round,
                                     const std::string& model_sha256) const {
  if (!sparse_) return;
  std::vector<std::string> names;
  for (const auto& t : plan_->tensors()) names.push_back(t.name);
  sparse_->save(path, names, round, model_sha256);
}

bool SyncModel::load_sparse_residual(const std::string& path, int64_t round,
                                     const std::string& model_sha256) {
  if (!sparse_) return false;
  std::vector<std::string> names;
  std::vector<int64_t> numels;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    names.push_back(plan_->tensors()[i].name);
    numels.push_back(tensors_[i].numel());
  }
  return sparse_->load(path, names, numels, round, model_sha256);
}

NamedTensors SyncModel::momentum_named() const {
  NamedTensors out;
  for (size_t i = 0; i < momentum_.size(); ++i)
    if (momentum_[i].defined()) out.emplace_back(plan_->tensors()[i].name, momentum_[i]);
  return out;
}

void SyncModel::load_momentum(const NamedTensors& tensors, const std::string& origin) {
  for (const auto& [name, t] : tensors) {
    const int64_t i = plan_->index(name);
    SPES_CHECK(i >= 0, "{}: momentum tensor '{}' is not part of the model", origin, name);
    SPES_CHECK(t.sizes() == tensors_[i].sizes(), "{}: momentum tensor '{}' has the wrong shape",
               origin, name);
    SPES_CHECK(torch::isfinite(t).all().item<bool>(), "{}: momentum tensor '{}' is not finite",
               origin, name);
    momentum_[i] = t.to(torch::kFloat32).clone();
  }
}

// ---------------------------------------------------------------------------------------------
RoundAggregator::RoundAggregator(SyncModel& model)
    : model_(model), schedule_(MergeSchedule::from_config(model.config())),
      statistic_(model.config().spes_config.bounds.aggregation) {}

void RoundAggregator::begin(int64_t round, int64_t step) {
  SPES_CHECK(!active_, "aggregator: round {} is still open", round_);
  active_ = true;
  round_ = round;
  step_ = step;
  node_ = last_node_ = -1;
  acc_.assign(model_.tensors().size(), torch::Tensor());
  wsum_.assign(model_.tensors().size(), 0.0);
  first_node_.assign(model_.tensors().size(), -1);
  held_.assign(model_.tensors().size(), {});
  owner_files_.clear();
  merge_excluded_.clear();
  out_ = RoundOutcome();
  out_.round = round;
  out_.step = step;
}

void RoundAggregator::abort() {
  active_ = false;
  acc_.clear();
  wsum_.clear();
  held_.clear();
  owner_files_.clear();
  node_ = -1;
}

void RoundAggregator::begin_node(int64_t node, int64_t tokens, const std::string& source_file) {
  const RoundPlan& plan = model_.plan();
  SPES_CHECK(active_, "aggregator: no round open");
  SPES_CHECK(node_ < 0, "aggregator: node {} is still being folded", node_);
  SPES_CHECK(node >= 0 && node < plan.num_nodes(), "aggregator: node {} outside [0, {})", node,
             plan.num_nodes());
  SPES_CHECK(node > last_node_, "aggregator: node {} folded after node {} (uploads are folded "
             "once each, in ascending node order)", node, last_node_);
  const bool by_tokens = model_.config().spes_config.weighting == Weighting::Tokens;
  SPES_CHECK(!by_tokens || tokens > 0, "aggregator: node {} reports {} tokens; weighting=tokens "
             "needs a positive count", node, tokens);
  node_ = node;
  weight_ = by_tokens ? static_cast<double>(tokens) : 1.0;
  source_ = source_file;
  expect_ = plan.upload_of(node);
  got_ = 0;
  filled_ = 0;
  out_.nodes.push_back(node);
  out_.tokens.push_back(tokens);
  out_.weights.push_back(weight_);
}

void RoundAggregator::add(const std::string& name, const torch::Tensor& value) {
  add_run(name, 0, value.reshape({-1}), true);
}

void RoundAggregator::add_run(const std::string& name, int64_t first, const torch::Tensor& run,
                              bool last) {
  const RoundPlan& plan = model_.plan();
  SPES_CHECK(node_ >= 0, "aggregator: add('{}') outside a node's upload", name);
  const int64_t i = plan.index(name);
  SPES_CHECK(i >= 0, "aggregator: '{}' is not part of the model", name);
  SPES_CHECK(got_ < expect_.size() && expect_[got_] == static_cast<size_t>(i),
             "aggregator: node {} sent '{}' out of order or not in its upload set", node_, name);
  const PlanTensor& t = plan.tensors()[i];
  int64_t numel = 1;
  for (int64_t d : t.shape) numel *= d;
  const bool owner_copy = t.rule == Combine::OwnerCopy;
  // An owner copy of an upload folded from a file may be noted whole without its values:
  // finish() reads them from the file (add_from_source).
  const bool noted = owner_copy && !source_.empty() && first == 0 && run.numel() == 0 && last;
  SPES_CHECK(first == filled_ && first + run.numel() <= numel &&
                 (!last || noted || first + run.numel() == numel),
             "aggregator: '{}' elements [{}, {}) arrive out of place (tensor has {})", name,
             first, first + run.numel(), numel);
  torch::NoGradGuard ng;
  if (!owner_copy && statistic_ != Aggregation::Mean) {
    // Median / trimmed mean: each node's value is kept until finish().
    if (first == 0) held_[i].push_back(torch::empty(t.shape, torch::kFloat32));
    held_[i].back().view({-1}).slice(0, first, first + run.numel())
        .copy_(run.detach().to(torch::kCPU, torch::kFloat32));
  } else if (!(owner_copy && !source_.empty())) {  // file-backed owner copies: in finish()
    torch::Tensor v = run.detach().to(torch::kCPU, torch::kFloat32);
    if (!acc_[i].defined()) {
      acc_[i] = torch::empty(t.shape, torch::kFloat32);
      first_node_[i] = node_;
    }
    torch::Tensor dst = acc_[i].view({-1}).slice(0, first, first + run.numel());
    if (owner_copy || first_node_[i] == node_) {
      dst.copy_(owner_copy || weight_ == 1.0 ? v : v.mul(weight_));
    } else {
      dst.add_(v, weight_);
    }
  }
  filled_ += run.numel();
  if (last) {
    if (owner_copy) {
      wsum_[i] = 1.0;
    } else {
      wsum_[i] += weight_;
    }
    ++got_;
    filled_ = 0;
  }
}

void RoundAggregator::add_from_source(const std::string& name) {
  const RoundPlan& plan = model_.plan();
  const int64_t i = plan.index(name);
  SPES_CHECK(i >= 0 && plan.tensors()[i].rule == Combine::OwnerCopy && !source_.empty(),
             "aggregator: '{}' is not an owner-copied tensor of an upload read from a file", name);
  add_run(name, 0, torch::empty({0}), true);
}

void RoundAggregator::end_node() {
  SPES_CHECK(node_ >= 0, "aggregator: end_node without begin_node");
  SPES_CHECK(got_ == expect_.size(), "aggregator: node {} sent {} of its {} tensors", node_, got_,
             expect_.size());
  if (!source_.empty()) owner_files_.emplace_back(node_, source_);
  last_node_ = node_;
  node_ = -1;
}

void RoundAggregator::keep_owner_delta(const RoundPlan& plan, int64_t node,
                                       const std::string& path, uint64_t header_bytes,
                                       const StreamEntry& e) {
  // The entries of a compressed upload: "NAME:scale" (F32) and NAME (I8 / BF16).
  const std::string suffix = ":scale";
  const bool scale = e.name.size() > suffix.size() &&
                     e.name.compare(e.name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
                     plan.compression() == Compression::Int8;
  const int64_t i = plan.index(scale ? e.name.substr(0, e.name.size() - suffix.size()) : e.name);
  if (i < 0) return;
  const PlanTensor& t = plan.tensors()[i];
  if (t.rule != Combine::OwnerCopy || t.owner != node) return;
  StagedDelta& d = out_.owner_deltas[static_cast<size_t>(i)];
  d.file = path;
  (scale ? d.scales_at : d.q_at) = header_bytes + e.begin;
  if (!scale) d.bytes = e.end - e.begin;
}

RoundOutcome RoundAggregator::finish() {
  SPES_CHECK(active_ && node_ < 0, "aggregator: finish() without a complete round");
  torch::NoGradGuard ng;
  out_.change.assign(model_.tensors().size(), 0.0);
  copy_owner_uploads();
  combine_averaged_tensors();
  // A round without any upload (every one was refused) publishes the model unchanged: no
  // merge either (docs/PROTOCOL.md, "Round state machine").
  if (!out_.nodes.empty()) merge_experts();
  round_to_transfer_dtype();
  active_ = false;
  acc_.clear();
  wsum_.clear();
  held_.clear();
  return out_;
}

void RoundAggregator::copy_owner_uploads() {
  // Owner copies straight from the staged uploads into the published tensors (only their
  // sections read, without compression; a compressed upload is streamed and rebuilt against
  // them first: they still hold the previous round's values).
  const RoundPlan& plan = model_.plan();
  const auto& pub = model_.tensors();
  if (plan.compression() == Compression::None) {
    // Each node's file on a thread of its own: they write disjoint tensors (every owner-copied
    // tensor has one owner) and disjoint entries of change.
    at::parallel_for(0, static_cast<int64_t>(owner_files_.size()), 1,
                     [&](int64_t lo, int64_t hi) {
                       for (int64_t k = lo; k < hi; ++k)
                         copy_owner_sections(plan, owner_files_[k].first,
                                             owner_files_[k].second, pub, out_.change);
                     });
  } else {
    for (const auto& [node, path] : owner_files_) copy_owner_delta_upload(node, path);
  }
  owner_files_.clear();
}

void RoundAggregator::copy_owner_delta_upload(int64_t node, const std::string& path) {
  const RoundPlan& plan = model_.plan();
  const auto& pub = model_.tensors();
  SafetensorsStreamReader reader(fs::file_size(path), path, nullptr, nullptr, kMaxHeaderBytes);
  DeltaStreamDecoder decoder(
      plan.compression(),
      [&](const StreamEntry& e) { return pub[plan.index(e.name)].view({-1}); },
      [&](const StreamEntry& e, int64_t first, const torch::Tensor& run, bool) {
        const int64_t i = plan.index(e.name);
        const PlanTensor& t = plan.tensors()[i];
        if (t.rule != Combine::OwnerCopy || t.owner != node) return;
        const torch::Tensor v = run.to(torch::kFloat32).contiguous();
        SPES_CHECK(pub[i].is_contiguous() && first >= 0 && first + v.numel() <= pub[i].numel(),
                   "{}: values [{}, {}) of '{}' outside the tensor", path, first,
                   first + v.numel(), e.name);
        out_.change[i] += copy_with_squared_change(v.data_ptr<float>(),
                                                   pub[i].data_ptr<float>() + first, v.numel());
      },
      path, plan.topk());
  reader.set_slice_handler([&](const StreamEntry& e, int64_t first, const torch::Tensor& run,
                               bool last) {
    if (first == 0) keep_owner_delta(plan, node, path, reader.header().header_bytes, e);
    decoder(e, first, run, last);
  });
  stream_file(path, reader);
}

void RoundAggregator::combine_averaged_tensors() {
  const RoundPlan& plan = model_.plan();
  const auto& pub = model_.tensors();
  const bool outer = model_.config().spes_config.uses_outer_step();
  outer_dot_ = outer_delta_sq_ = outer_m_sq_ = 0;
  bool stepped = false;
  for (size_t i = 0; i < pub.size(); ++i) {
    torch::Tensor& acc = acc_[i];
    if (!held_[i].empty())
      acc = robust_combine(held_[i], statistic_, model_.config().spes_config.bounds.trim_fraction);
    held_[i].clear();
    if (!acc.defined()) {  // nobody uploaded it (or an owner copy read back above)
      out_.change[i] = std::sqrt(out_.change[i]);
      continue;
    }
    const bool averaged = plan.tensors()[i].rule == Combine::Mean;
    if (averaged && statistic_ == Aggregation::Mean && wsum_[i] != 1.0) acc.div_(wsum_[i]);
    if (outer && averaged) {
      apply_outer_step(i, acc);
      stepped = true;
    }
    out_.change[i] = (acc - pub[i]).norm().item<double>();
    pub[i].copy_(acc);
    acc = torch::Tensor();
  }
  if (stepped) {
    out_.outer_change_norm = std::sqrt(outer_delta_sq_);
    out_.outer_momentum_norm = std::sqrt(outer_m_sq_);
    if (outer_delta_sq_ > 0 && outer_m_sq_ > 0)
      out_.outer_momentum_cos = outer_dot_ / std::sqrt(outer_delta_sq_ * outer_m_sq_);
  }
}

void RoundAggregator::apply_outer_step(size_t i, torch::Tensor& avg) {
  // delta = prev - avg; m = mu * m + delta; new = prev - lr * (delta + mu * m), computed as
  // avg + (1 - lr) * delta - lr * mu * m: the same value, and with lr 1 and mu 0 exactly the
  // average (FedAvg bit for bit).
  const double lr = model_.config().spes_config.outer.lr;
  const double mu = model_.config().spes_config.outer.momentum;
  const torch::Tensor delta = model_.tensors()[i] - avg;
  torch::Tensor& m = model_.momentum()[i];
  if (!m.defined()) m = torch::zeros_like(avg);
  // How this round's change lines up with the momentum so far (RoundOutcome), in double.
  outer_dot_ += delta.mul(m).sum(torch::kDouble).item<double>();
  outer_delta_sq_ += delta.square().sum(torch::kDouble).item<double>();
  outer_m_sq_ += m.square().sum(torch::kDouble).item<double>();
  m.mul_(mu).add_(delta);
  avg.add_(delta, 1 - lr).sub_(m, lr * mu);
}

void RoundAggregator::merge_experts() {
  const double alpha = schedule_.alpha(step_);
  if (alpha > 0) {
    auto layers = layer_experts(model_.plan(), model_.tensors());
    for (size_t l = 0; l < layers.size(); ++l) {
      auto& layer = layers[l];
      if (layer.size() < 2) continue;
      const auto cos = gate_cosine_matrix(layer);
      out_.gate_cos_before.push_back(mean_pairwise(cos));
      std::vector<bool> excluded(layer.size(), false);
      for (size_t e = 0; e < layer.size(); ++e)
        if (merge_excluded_.count({static_cast<int64_t>(l), static_cast<int64_t>(e)})) {
          excluded[e] = true;
          out_.merge_excluded.emplace_back(l, e);
        }
      experts_merge_layer(layer, merge_donors(cos, schedule_.topk, excluded), alpha);
      out_.merged = true;
    }
  }
  out_.alpha = out_.merged ? alpha : 0.0;
}

void RoundAggregator::round_to_transfer_dtype() {
  const RoundPlan& plan = model_.plan();
  for (const auto& t : model_.tensors()) wire_round_(t, plan.wire());
  for (const auto& layer : layer_experts(plan, model_.tensors()))
    out_.gate_cos.push_back(mean_pairwise(gate_cosine_matrix(layer)));
}

// ---------------------------------------------------------------------------------------------
namespace {
// A staged upload without compression whose values were checked as they arrived: the averaged
// tensors' sections are read (pread, 64K values at a time) and added, the owner-copied ones
// are left in the file for finish(). The header is checked as by the streaming fold.
UploadMeta fold_sections(RoundAggregator& agg, const RoundPlan& plan, const std::string& path,
                         int64_t expect_node) {
  const StreamHeader h = read_stream_header(path);
  const UploadMeta meta = check_upload_header(plan, h, expect_node, path);
  SPES_CHECK(meta.step == agg.step(), "{}: upload is for step {} (round {}) but the round being "
             "aggregated is step {} (round {})", path, meta.step, meta.round, agg.step(),
             agg.round());
  agg.begin_node(meta.node, meta.tokens, path);
  // Entries come in model order; an owner copy is noted when the reader passes over it.
  read_sections(
      plan, path, h,
      [&](const PlanTensor& t) {
        if (t.rule != Combine::OwnerCopy) return true;
        agg.add_from_source(t.name);
        return false;
      },
      [&](int64_t, const StreamEntry& e, int64_t first, float* v, int64_t m, bool last) {
        agg.add_run(e.name, first, torch::from_blob(v, {m}), last);
      });
  agg.end_node();
  return meta;
}
}  // namespace

UploadMeta fold_upload_file(RoundAggregator& agg, const RoundPlan& plan, const std::string& path,
                            int64_t expect_node, bool values_checked) {
  if (values_checked && plan.compression() == Compression::None)
    return fold_sections(agg, plan, path, expect_node);
  UploadMeta meta;
  SafetensorsStreamReader reader(
      fs::file_size(path), path,
      [&](const StreamHeader& h) {
        meta = check_upload_header(plan, h, expect_node, path);
        SPES_CHECK(meta.step == agg.step(), "{}: upload is for step {} (round {}) but the round "
                   "being aggregated is step {} (round {})", path, meta.step, meta.round,
                   agg.step(), agg.round());
        agg.begin_node(meta.node, meta.tokens, path);
      },
      nullptr, kMaxHeaderBytes);
  const auto& pub = agg.model().tensors();
  DeltaStreamDecoder decoder(
      plan.compression(),
      [&](const StreamEntry& e) { return pub[plan.index(e.name)].view({-1}); },
      [&](const StreamEntry& e, int64_t first, const torch::Tensor& run, bool last) {
        if (!values_checked) check_upload_run(e, run, path);
        agg.add_run(e.name, first, run, last);
      },
      path, plan.topk());
  reader.set_slice_handler(
      [&](const StreamEntry& e, int64_t first, const torch::Tensor& run, bool last) {
        decoder(e, first, run, last);
      });
  stream_file(path, reader);
  agg.end_node();
  return meta;
}

RoundOutcome aggregate_offline(SyncModel& model, const std::vector<std::string>& uploads,
                               int64_t step) {
  const RoundClock clock(model.config());
  SPES_CHECK(clock.is_sync_step(step), "aggregate: step {} is not a sync step (a positive "
             "multiple of spes_config.sync_steps={})", step, clock.sync_steps());
  std::vector<std::pair<int64_t, std::string>> order;
  for (const auto& path : uploads) {
    const UploadMeta m = check_upload_header(model.plan(), read_stream_header(path), -1, path);
    for (const auto& [n, p] : order)
      SPES_CHECK(n != m.node, "aggregate: '{}' and '{}' are both uploads of node {}", p, path,
                 m.node);
    order.emplace_back(m.node, path);
  }
  std::sort(order.begin(), order.end());
  // With compression the published model is P_prev + deq(D) (published_delta.h), computed
  // against the previous model as the server does.
  std::vector<torch::Tensor> prev;
  if (model.plan().compression() != Compression::None)
    for (const auto& t : model.tensors()) prev.push_back(t.clone());
  RoundAggregator agg(model);
  agg.begin(clock.round_at(step), step);
  for (const auto& [node, path] : order) fold_upload_file(agg, model.plan(), path, node);
  RoundOutcome o = agg.finish();
  if (!prev.empty()) quantise_publication(model, o, prev);
  return o;
}

SafetensorsStreamWriter published_writer(const SyncModel& model, int64_t round, int64_t step,
                                         const std::string& sha256) {
  return SafetensorsStreamWriter(model.named(), torch::kFloat32,
                                 {{"format", "spes-published-v1"},
                                  {"round", std::to_string(round)},
                                  {"step", std::to_string(step)},
                                  {"model_sha256", sha256}});
}

std::vector<std::vector<ExpertMats>> layer_experts(const RoundPlan& plan,
                                                   const std::vector<torch::Tensor>& tensors) {
  int64_t L = 0, E = 0;
  for (const auto& t : plan.tensors())
    if (t.role == ParamRole::Expert) {
      L = std::max(L, t.layer + 1);
      E = std::max(E, t.expert + 1);
    }
  std::vector<std::vector<ExpertMats>> out(L, std::vector<ExpertMats>(E));
  for (int64_t l = 0; l < L; ++l)
    for (int64_t e = 0; e < E; ++e) {
      auto get = [&](const char* proj) {
        const int64_t i = plan.index(expert_param_name(l, e, proj));
        SPES_CHECK(i >= 0, "merge: model has no tensor '{}'", expert_param_name(l, e, proj));
        return tensors[i];
      };
      out[l][e] = {get("gate_proj"), get("up_proj"), get("down_proj")};
    }
  return out;
}

}  // namespace spes::sync
