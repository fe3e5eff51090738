// The handed-over moments' stream form and its checks (moments_handoff.h).
#include "spes/sync/round/moments_handoff.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <map>
#include <set>

#include "spes/common/strings.h"
#include "spes/io/files.h"
#include "spes/model/transformer.h"
#include "spes/sync/wire/protocol.h"

namespace spes::sync {
namespace {

const std::array<const char*, 4> kParts = {"exp_avg/", "exp_avg_sq/", "step/", "rewarm_from/"};
const std::array<const char*, 3> kProjs = {"gate_proj", "up_proj", "down_proj"};

// "exp_avg/NAME" -> {0, NAME}; {-1, ""} for any other form.
std::pair<int, std::string> split_name(const std::string& full) {
  for (int i = 0; i < static_cast<int>(kParts.size()); ++i) {
    const std::string p = kParts[i];
    if (full.compare(0, p.size(), p) == 0 && full.size() > p.size())
      return {i, full.substr(p.size())};
  }
  return {-1, ""};
}

int64_t scalar_of(const torch::Tensor& t, const std::string& name, const std::string& origin) {
  if (t.scalar_type() != torch::kInt64 || t.numel() != 1 || t.dim() != 0)
    sync_fail(SyncErrc::InvalidArgument, "{}: '{}' must be an int64 scalar", origin, name);
  return t.item<int64_t>();
}

void check_moment(const torch::Tensor& t, const PlanTensor& p, const std::string& name,
                  bool second, const std::string& origin) {
  if (t.scalar_type() != torch::kFloat32)
    sync_fail(SyncErrc::InvalidArgument, "{}: '{}' must be F32", origin, name);
  if (t.sizes().vec() != p.shape)
    sync_fail(SyncErrc::InvalidArgument, "{}: '{}' has shape [{}] but the model's tensor has "
              "[{}]", origin, name, fmt::join(t.sizes(), ", "), fmt::join(p.shape, ", "));
  if (!torch::isfinite(t).all().item<bool>())
    sync_fail(SyncErrc::InvalidArgument, "{}: '{}' holds NaN or Inf values", origin, name);
  if (second && !(t >= 0).all().item<bool>())
    sync_fail(SyncErrc::InvalidArgument, "{}: '{}' has negative values (a second moment is a "
              "mean of squares)", origin, name);
}

void check_metadata(const RoundPlan& plan, const Metadata& md, int64_t node,
                    const std::string& origin) {
  auto f = md.find("format");
  if (f == md.end() || f->second != kMomentsFormat)
    sync_fail(SyncErrc::InvalidArgument, "{}: metadata format must be '{}'", origin,
              kMomentsFormat);
  const int64_t from = metadata_int(md, "node_id", origin);
  if (from != node)
    sync_fail(SyncErrc::InvalidArgument, "{}: the moments say node {} but come from node {}",
              origin, from, node);
  // A node may not have applied the collecting round's map yet (it comes with the round it
  // has not downloaded): an older epoch is fine for the experts it still owns (checked per
  // tensor), an epoch the server has not decided is not.
  const int64_t epoch = metadata_int(md, "ownership_epoch", origin);
  const auto kind = md.find("handover");
  if (kind != md.end() && kind->second != "departing" && kind->second != kHandoverLost)
    sync_fail(SyncErrc::InvalidArgument, "{}: metadata handover '{}' is neither 'departing' nor "
              "'{}'", origin, printable(kind->second, 40), kHandoverLost);
  if (moments_lost(md)) {
    if (epoch != plan.ownership_epoch() - 1)
      sync_fail(SyncErrc::InvalidArgument, "{}: moments of experts lost to an arrival must be "
                "those owned under ownership epoch {} (the one before the round being "
                "collected, epoch {}), not epoch {}", origin, plan.ownership_epoch() - 1,
                plan.ownership_epoch(), epoch);
    metadata_int(md, "step", origin);
    return;
  }
  if (epoch > plan.ownership_epoch())
    sync_fail(SyncErrc::InvalidArgument, "{}: the moments were owned under ownership epoch {} "
              "but the round being collected uses epoch {}: only the experts a node owns now "
              "can be handed over", origin, epoch, plan.ownership_epoch());
  metadata_int(md, "step", origin);
}

}  // namespace

bool moments_lost(const Metadata& md) {
  const auto kind = md.find("handover");
  return kind != md.end() && kind->second == kHandoverLost;
}

NamedTensors moments_tensors(const ExpertMoments& m) {
  NamedTensors out;
  for (const auto& [name, e] : m.by_name) {  // std::map: ascending names
    out.emplace_back(kParts[0] + name, e.exp_avg.to(torch::kCPU, torch::kFloat32).contiguous());
    out.emplace_back(kParts[1] + name,
                     e.exp_avg_sq.to(torch::kCPU, torch::kFloat32).contiguous());
    out.emplace_back(kParts[2] + name, torch::tensor(e.step, torch::kInt64));
    out.emplace_back(kParts[3] + name, torch::tensor(e.rewarm_from, torch::kInt64));
  }
  return out;
}

Metadata moments_metadata(const MomentsMeta& meta) {
  return {{"format", kMomentsFormat},
          {"node_id", std::to_string(meta.node)},
          {"ownership_epoch", std::to_string(meta.ownership_epoch)},
          {"step", std::to_string(meta.step)},
          {"handover", meta.lost ? kHandoverLost : "departing"}};
}

ExpertMoments moments_from_tensors(const NamedTensors& ts, const std::string& origin) {
  std::map<std::string, std::array<const torch::Tensor*, 4>> parts;
  for (const auto& [full, t] : ts) {
    auto [i, name] = split_name(full);
    if (i < 0)
      sync_fail(SyncErrc::InvalidArgument, "{}: '{}' is not a moments entry (exp_avg/, "
                "exp_avg_sq/, step/ or rewarm_from/ and a tensor name)", origin,
                printable(full, 120));
    auto& slot = parts[name];
    if (slot[i])
      sync_fail(SyncErrc::InvalidArgument, "{}: '{}' appears twice", origin, printable(full, 120));
    slot[i] = &t;
  }
  ExpertMoments out;
  for (const auto& [name, p] : parts) {
    for (int i = 0; i < 4; ++i)
      if (!p[i])
        sync_fail(SyncErrc::InvalidArgument, "{}: '{}{}' is missing", origin, kParts[i],
                  printable(name, 120));
    out.by_name[name] = {*p[0], *p[1], scalar_of(*p[2], kParts[2] + name, origin),
                         scalar_of(*p[3], kParts[3] + name, origin)};
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> check_moments_handoff(const RoundPlan& plan,
                                                               const NamedTensors& ts,
                                                               const Metadata& md, int64_t node,
                                                               const std::string& origin,
                                                               const Ownership* previous) {
  const bool lost = moments_lost(md);
  if (lost && !previous)
    sync_fail(SyncErrc::InvalidArgument, "{}: ownership epoch {} is the run's first: no node "
              "has lost experts yet", origin, plan.ownership_epoch());
  check_metadata(plan, md, node, origin);
  const ExpertMoments m = moments_from_tensors(ts, origin);
  if (m.by_name.empty())
    sync_fail(SyncErrc::InvalidArgument, "{}: no moments in the handover", origin);
  std::set<std::pair<int64_t, int64_t>> experts;
  for (const auto& [name, e] : m.by_name) {
    const int64_t i = plan.index(name);
    if (i < 0)
      sync_fail(SyncErrc::InvalidArgument, "{}: '{}' is not a tensor of the model", origin,
                printable(name, 120));
    const PlanTensor& p = plan.tensors()[static_cast<size_t>(i)];
    if (p.role != ParamRole::Expert)
      sync_fail(SyncErrc::InvalidArgument, "{}: '{}' is a shared tensor: only experts' moments "
                "move with them", origin, name);
    bool trains = false;
    for (int64_t u : p.uploaders) trains = trains || u == node;
    if (lost) {
      const int64_t before = previous->owner(p.layer, p.expert);
      if (before != node)
        sync_fail(SyncErrc::InvalidArgument, "{}: expert {} of layer {} ('{}') was owned by node "
                  "{} in ownership epoch {}, not by node {}: a node hands over only experts it "
                  "lost", origin, p.expert, p.layer, name, before, plan.ownership_epoch() - 1,
                  node);
      if (trains)
        sync_fail(SyncErrc::InvalidArgument, "{}: node {} still owns expert {} of layer {} "
                  "('{}') in ownership epoch {}: only experts it lost are handed over", origin,
                  node, p.expert, p.layer, name, plan.ownership_epoch());
    } else if (!trains)
      sync_fail(SyncErrc::InvalidArgument, "{}: expert {} of layer {} ('{}') is owned by node {} "
                "in ownership epoch {}, not by node {}: a node hands over only its own experts",
                origin, p.expert, p.layer, name, p.owner, plan.ownership_epoch(), node);
    check_moment(e.exp_avg, p, "exp_avg/" + name, false, origin);
    check_moment(e.exp_avg_sq, p, "exp_avg_sq/" + name, true, origin);
    if (e.step < 0)
      sync_fail(SyncErrc::InvalidArgument, "{}: step/{} is {}, negative", origin, name, e.step);
    if (e.rewarm_from < -1)
      sync_fail(SyncErrc::InvalidArgument, "{}: rewarm_from/{} is {} (a step, or -1: none)",
                origin, name, e.rewarm_from);
    experts.insert({p.layer, p.expert});
  }
  for (const auto& [l, x] : experts)
    for (const char* proj : kProjs)
      if (!m.by_name.count(expert_param_name(l, x, proj)))
        sync_fail(SyncErrc::InvalidArgument, "{}: the moments of expert {} of layer {} lack "
                  "'{}': an expert's moments come whole (all three projections)", origin, x, l,
                  expert_param_name(l, x, proj));
  return {experts.begin(), experts.end()};
}

uint64_t max_moments_bytes(const RoundPlan& plan, int64_t node, const Ownership* previous) {
  uint64_t bytes = 64 << 10;  // header: metadata and slack
  for (const PlanTensor& p : plan.tensors()) {
    if (p.role != ParamRole::Expert) continue;
    bool trains = previous && previous->owner(p.layer, p.expert) == node;
    for (int64_t u : p.uploaders) trains = trains || u == node;
    if (!trains) continue;
    uint64_t numel = 1;
    for (int64_t d : p.shape) numel *= static_cast<uint64_t>(d);
    bytes += numel * 8 + 16 + 4 * (p.name.size() + 128);  // values, scalars, header entries
  }
  return bytes;
}

std::string moments_sha256(const ExpertMoments& m) {
  std::string s;
  auto hex = [](const torch::Tensor& t) {
    const torch::Tensor c = t.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    return sha256_hex(c.data_ptr(), static_cast<size_t>(c.numel()) * sizeof(float));
  };
  for (const auto& [name, e] : m.by_name)
    s += fmt::format("{}\n{}\n{}\n{}\n{}\n", name, e.step, e.rewarm_from, hex(e.exp_avg),
                     hex(e.exp_avg_sq));
  return sha256_hex(s);
}

}  // namespace spes::sync
