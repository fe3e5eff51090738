// Round plan and upload checks (see plan.h).
#include "spes/sync/round/plan.h"

#include <fmt/ranges.h>

#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/io/files.h"
#include "spes/model/ownership.h"
#include "spes/model/registry.h"
#include "spes/sync/round/join_settings.h"
#include "spes/sync/wire/topk_codec.h"
#include "spes/sync/wire/protocol.h"

namespace spes::sync {

RoundPlan::RoundPlan(const Config& cfg, const Transformer& model)
    : RoundPlan(cfg, model, Ownership::from_config(cfg), 0) {}

RoundPlan::RoundPlan(const Config& cfg, const Transformer& model, const Ownership& ownership,
                     int64_t epoch)
    : num_nodes_(cfg.spes_config.node_slots()), mode_(cfg.spes_config.mode),
      wire_(wire_dtype_of(cfg.spes_config.transfer.dtype)),
      compression_(cfg.spes_config.transfer.compression),
      topk_(topk_params(cfg.spes_config.transfer)),
      topk_published_(topk_published_params(cfg.spes_config.transfer)), ownership_(ownership), epoch_(epoch) {
  SPES_CHECK(mode_ != SyncMode::Centralized,
             "spes_config.mode is centralized: a sync server needs mode spes, fedavg or diloco "
             "(centralized training has nothing to synchronise)");
  for (const auto& p : model.params()) {
    PlanTensor t;
    t.name = p.name;
    t.shape = p.tensor.sizes().vec();
    t.role = p.role;
    t.layer = p.layer;
    t.expert = p.expert;
    if (p.role == ParamRole::Expert) t.owner = ownership.owner(p.layer, p.expert);
    t.rule = (p.role == ParamRole::Expert && mode_ == SyncMode::Spes) ? Combine::OwnerCopy
                                                                     : Combine::Mean;
    by_name_[t.name] = tensors_.size();
    tensors_.push_back(std::move(t));
  }
  upload_.resize(num_nodes_);
  for (int64_t node = 0; node < num_nodes_; ++node) {
    const ParamRegistry reg(model, cfg, ownership, node);
    SPES_CHECK(reg.entries().size() == tensors_.size(), "round plan: registry/model mismatch");
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const auto& e = reg.entries()[i];
      SPES_CHECK(e.name == tensors_[i].name, "round plan: registry order differs from the model");
      if (!e.trainable) continue;
      tensors_[i].uploaders.push_back(node);
      upload_[node].push_back(i);
    }
  }
  for (const auto& t : tensors_)
    SPES_CHECK(t.rule != Combine::OwnerCopy ||
                   (t.uploaders.size() <= 1 && (t.uploaders.empty() || t.uploaders[0] == t.owner)),
               "round plan: expert '{}' would be trained by nodes [{}] but is owned by node {}",
               t.name, fmt::join(t.uploaders, ","), t.owner);
  for (const auto& p : model.params()) p.tensor.set_requires_grad(false);
}

int64_t RoundPlan::index(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? -1 : static_cast<int64_t>(it->second);
}

std::vector<size_t> RoundPlan::download_for(int64_t node, bool merged) const {
  std::vector<size_t> out;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const auto& t = tensors_[i];
    const bool merged_here = merged && t.role == ParamRole::Expert;
    if (t.uploaders.empty() && !merged_here) continue;  // nobody changed it
    const bool own_copy = t.rule == Combine::OwnerCopy && t.owner == node &&
                          !t.uploaders.empty() && t.uploaders[0] == node;
    if (own_copy && !merged_here) continue;  // the node holds the published value already
    out.push_back(i);
  }
  return out;
}

uint64_t RoundPlan::upload_data_bytes(int64_t node) const {
  uint64_t n = 0;
  for (size_t i : upload_.at(node)) {
    uint64_t numel = 1;
    for (int64_t d : tensors_[i].shape) numel *= static_cast<uint64_t>(d);
    n += compression_ == Compression::None
             ? numel * c10::elementSize(wire_scalar_type(wire_))
             : delta_payload_bytes(compression_, static_cast<int64_t>(numel), topk_);
  }
  return n;
}

uint64_t RoundPlan::max_upload_header_bytes(int64_t node) const {
  // Per tensor: its name and the JSON around it ("dtype", "shape" with up to 20 digits per
  // dimension, "data_offsets"); the metadata's few short values fit in the slack.
  uint64_t n = 4096;
  const bool scales = compression_ == Compression::Int8;
  for (size_t i : upload_.at(node)) {
    n += tensors_[i].name.size() + 96 + 21 * tensors_[i].shape.size();
    if (scales) n += tensors_[i].name.size() + 8 + 96 + 21;  // "NAME:scale", [blocks]
  }
  return std::min<uint64_t>(n, kMaxHeaderBytes);
}

Metadata upload_metadata(const UploadMeta& m) {
  Metadata md = {{"format", "spes-upload-v1"},
                 {"node_id", std::to_string(m.node)},
                 {"incarnation", std::to_string(m.incarnation)},
                 {"round", std::to_string(m.round)},
                 {"step", std::to_string(m.step)},
                 {"tokens", std::to_string(m.tokens)},
                 {"model_fingerprint", m.model_fingerprint}};
  if (m.ownership_epoch >= 0) md["ownership_epoch"] = std::to_string(m.ownership_epoch);
  if (m.compression != Compression::None) md["compression"] = compression_name(m.compression);
  return md;
}

int64_t metadata_int(const Metadata& md, const char* key, const std::string& origin) {
  auto it = md.find(key);
  if (it == md.end())
    sync_fail(SyncErrc::InvalidArgument, "{}: metadata lacks '{}'", origin, key);
  try {
    size_t pos = 0;
    const long long v = std::stoll(it->second, &pos);
    if (pos == it->second.size() && v >= 0) return v;
  } catch (const std::exception&) {
  }
  sync_fail(SyncErrc::InvalidArgument, "{}: metadata '{}' = '{}' is not a non-negative "
            "integer", origin, key, printable(it->second, 40));
}

namespace {

// The upload's own description of itself: its format and the numbers the node wrote.
UploadMeta read_upload_meta(const Metadata& md, const std::string& origin) {
  auto fmt_it = md.find("format");
  if (fmt_it == md.end() || fmt_it->second != "spes-upload-v1")
    sync_fail(SyncErrc::InvalidArgument, "{}: not a SPES upload (metadata format '{}', expected "
              "'spes-upload-v1')", origin, fmt_it == md.end() ? "" : printable(fmt_it->second, 40));
  UploadMeta m;
  m.node = metadata_int(md, "node_id", origin);
  m.round = metadata_int(md, "round", origin);
  m.step = metadata_int(md, "step", origin);
  m.tokens = metadata_int(md, "tokens", origin);
  try {
    m.incarnation = std::stoull(md.count("incarnation") ? md.at("incarnation") : "0");
  } catch (const std::exception&) {
    sync_fail(SyncErrc::InvalidArgument, "{}: upload metadata 'incarnation' is not a number",
              origin);
  }
  if (md.count("model_fingerprint")) m.model_fingerprint = printable(md.at("model_fingerprint"));
  if (md.count("ownership_epoch"))
    m.ownership_epoch = metadata_int(md, "ownership_epoch", origin);
  return m;
}

// The sender, the compression and the ownership epoch agree with the round's plan.
void check_upload_sender(const RoundPlan& plan, const Metadata& md, int64_t expect_node,
                         UploadMeta& m, const std::string& origin) {
  if (expect_node >= 0 && m.node != expect_node)
    sync_fail(SyncErrc::InvalidArgument, "{}: upload says node {} but was sent by node {}",
              origin, m.node, expect_node);
  if (m.node >= plan.num_nodes())
    sync_fail(SyncErrc::InvalidArgument, "{}: node {} is outside [0, max_nodes={})", origin,
              m.node, plan.num_nodes());
  const Compression comp = plan.compression();
  const std::string comp_md = md.count("compression") ? md.at("compression") : "none";
  if (comp_md != compression_name(comp))
    sync_fail(SyncErrc::InvalidArgument, "{}: the upload says compression '{}' but "
              "spes_config.compression is {}", origin, printable(comp_md, 40),
              compression_name(comp));
  m.compression = comp;
  if (m.ownership_epoch >= 0 && m.ownership_epoch != plan.ownership_epoch())
    sync_fail(SyncErrc::InvalidArgument, "{}: node {} trained under ownership epoch {} but "
              "round {} uses epoch {}: the node must change to the map that came with the "
              "round it downloaded; the upload is refused and the model is unchanged", origin,
              m.node, m.ownership_epoch, m.round, plan.ownership_epoch());
}

// The k-th tensor of node `node`'s upload: one the node trains, in model order, of the shape
// and dtype the plan and the compression give (a top-k entry: its own checks).
void check_upload_entry(const RoundPlan& plan, int64_t node, size_t k, const StreamEntry& e,
                        const std::string& origin) {
  const int64_t idx = plan.index(e.name);
  if (idx < 0)
    sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}' is not part of the model", origin,
              printable(e.name));
  const PlanTensor& t = plan.tensors()[idx];
  const bool allowed =
      std::find(t.uploaders.begin(), t.uploaders.end(), node) != t.uploaders.end();
  if (!allowed)
    sync_fail(SyncErrc::InvalidArgument, "{}: node {} may not upload '{}' ({})", origin, node,
              e.name, t.role == ParamRole::Expert
                          ? fmt::format("expert owned by node {} in ownership epoch {}; an "
                                        "expert the node no longer owns is refused and the "
                                        "model unchanged", t.owner, plan.ownership_epoch())
                          : std::string("frozen on every node"));
  const auto& want = plan.upload_of(node);
  if (k >= want.size() || want[k] != static_cast<size_t>(idx))
    sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}' is out of order or duplicated (an "
              "upload lists the node's tensors once each, in model order)", origin, e.name);
  const Compression comp = plan.compression();
  if (comp == Compression::Topk) {
    const std::string why = delta_entry_problem(e, t.shape, comp, plan.topk());
    if (!why.empty())
      sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}': {}", origin, e.name, why);
    return;
  }
  if (e.shape != t.shape)
    sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}' has shape [{}], the model has [{}]",
              origin, e.name, fmt::join(e.shape, ", "), fmt::join(t.shape, ", "));
  const bool fp = comp == Compression::None;
  const torch::ScalarType dtype = fp ? wire_scalar_type(plan.wire()) : delta_wire_dtype(comp);
  if (e.dtype != dtype)
    sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}' is {} but {} {} (expected {})",
              origin, e.name, safetensors_dtype_name(e.dtype),
              fp ? "transfer_dtype is" : "compression is",
              fp ? wire_dtype_name(plan.wire()) : compression_name(comp),
              safetensors_dtype_name(dtype));
}

}  // namespace

UploadMeta check_upload_header(const RoundPlan& plan, const StreamHeader& header,
                               int64_t expect_node, const std::string& origin) {
  UploadMeta m = read_upload_meta(header.metadata, origin);
  check_upload_sender(plan, header.metadata, expect_node, m, origin);
  const std::vector<StreamEntry> got =
      delta_tensor_entries(header.entries, plan.compression(), origin);
  for (size_t k = 0; k < got.size(); ++k) check_upload_entry(plan, m.node, k, got[k], origin);
  const auto& want = plan.upload_of(m.node);
  if (got.size() != want.size())
    sync_fail(SyncErrc::InvalidArgument, "{}: upload holds {} tensors but node {} trains {} "
              "(first missing: '{}')", origin, got.size(), m.node, want.size(),
              plan.tensors()[want[got.size()]].name);
  return m;
}

void check_upload_tokens(const Config& cfg, const UploadMeta& meta, const std::string& origin) {
  const SpesConfig& sc = cfg.spes_config;
  // At most every sequence of every step since the last sync (in 128 bits: config values are
  // bounded, but the product is checked, not trusted).
  const __int128 most = static_cast<__int128>(sc.sync_steps) * cfg.global_train_batch_size *
                        cfg.model.max_sequence_length;
  if (static_cast<__int128>(meta.tokens) > most)
    sync_fail(SyncErrc::InvalidArgument, "{}: the upload claims {} tokens, more than one round "
              "can train (sync_steps {} x global_train_batch_size {} x max_sequence_length {} = "
              "{}); the upload is rejected", origin, meta.tokens, sc.sync_steps,
              cfg.global_train_batch_size, cfg.model.max_sequence_length,
              static_cast<int64_t>(most));
  if (sc.weighting == Weighting::Tokens && meta.tokens == 0)
    sync_fail(SyncErrc::InvalidArgument, "{}: the upload claims 0 tokens; with "
              "spes_config.weighting=tokens a round's upload must report the tokens it trained "
              "(a positive count); the upload is rejected", origin);
}

void check_upload_run(const StreamEntry& entry, const torch::Tensor& t,
                      const std::string& origin) {
  if (t.numel() > 0 && !torch::isfinite(t).all().item<bool>())
    sync_fail(SyncErrc::InvalidArgument, "{}: tensor '{}' holds NaN or Inf values; the upload "
              "is rejected", origin, entry.name);
}

std::string model_config_sha256(const Config& cfg) {
  Config c;
  c.model = cfg.model;
  return sha256_hex(config_to_yaml(c));
}

JoinInfo node_join_info(const Config& cfg, const ParamRegistry& registry, const NodeId& id,
                        int64_t step) {
  JoinInfo j;
  j.node = id;
  j.protocol_version = kProtocolVersion;
  const std::string fingerprint = registry.fingerprint();
  j.settings = join_setting_values({cfg, fingerprint});
  j.step = step;
  j.expert_capacity = cfg.spes_config.elastic.expert_capacity;
  j.memory_capacity_gib = cfg.spes_config.elastic.memory_capacity_gib;
  return j;
}

SafetensorsStreamWriter node_upload_writer(const ParamRegistry& registry, const UploadMeta& meta,
                                           WireDtype wire) {
  NamedTensors t;
  for (const auto& e : registry.entries())
    if (e.trainable) t.emplace_back(e.name, e.tensor.detach());
  return SafetensorsStreamWriter(std::move(t), wire_scalar_type(wire), upload_metadata(meta));
}

}  // namespace spes::sync
