// A node's side of the moments handover (protocol 9, docs/PROTOCOL.md "Handing over the
// moments"): a node departing for good sends the AdamW moments of the experts it owns, a live
// node that loses experts to an arrival sends theirs (protocol 10); a node whose map gains
// experts fetches the moments handed over for them before it changes its trainable set.
#include <spdlog/spdlog.h>

#include <map>
#include <set>

#include "spes/model/registry.h"
#include "spes/model/transformer.h"
#include "spes/sync/node/node_calls.h"
#include "spes/sync/round/moments_handoff.h"

namespace spes::sync {
namespace {

// [layer, expert] where `table` is true and `except` (when given) is not.
std::vector<std::pair<int64_t, int64_t>> experts_of(const std::vector<std::vector<bool>>& table,
                                                    const std::vector<std::vector<bool>>* except) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (size_t l = 0; l < table.size(); ++l)
    for (size_t e = 0; e < table[l].size(); ++e)
      if (table[l][e] && !(except && (*except)[l][e]))
        out.emplace_back(static_cast<int64_t>(l), static_cast<int64_t>(e));
  return out;
}

}  // namespace

void SyncNode::hand_over_moments(Trainer& t) {
  const int64_t node = client_->id().node_id;
  const auto mine =
      experts_of(trainable_expert_table(t.config(), t.ownership(), node), nullptr);
  if (mine.empty()) return;
  try {
    const ExpertMoments m = t.expert_moments(mine);
    const SafetensorsStreamWriter payload = SafetensorsStreamWriter::as_stored(
        moments_tensors(m), moments_metadata({node, ownership_epoch_, t.state().step}));
    const int64_t kept = call("hand over moments", 60, [&] { return client_->hand_over(payload); });
    spdlog::info("node {}: handed over the AdamW moments of {} experts ({} bytes, ownership "
                 "epoch {}, step {})", node, kept, payload.total_bytes(), ownership_epoch_,
                 t.state().step);
  } catch (const std::exception& e) {
    spdlog::warn("node {}: could not hand over the AdamW moments of its experts ({}); their "
                 "next owners start from zero moments with a re-warm-up", node, e.what());
  }
}

nlohmann::json SyncNode::hand_over_lost_moments(const Trainer& t, const Ownership& next,
                                                int64_t epoch) {
  const int64_t node = client_->id().node_id;
  const auto after = trainable_expert_table(t.config(), next, node);
  const auto lost = experts_of(trainable_expert_table(t.config(), t.ownership(), node), &after);
  if (lost.empty()) return nullptr;
  if (epoch != ownership_epoch_ + 1) {
    spdlog::warn("node {}: it loses {} experts going from ownership epoch {} to {} (it missed "
                 "an epoch): their moments are not handed over", node, lost.size(),
                 ownership_epoch_, epoch);
    return nullptr;
  }
  try {
    const ExpertMoments m = t.expert_moments(lost);
    const SafetensorsStreamWriter payload = SafetensorsStreamWriter::as_stored(
        moments_tensors(m),
        moments_metadata({node, ownership_epoch_, t.state().step, /*lost=*/true}));
    const int64_t kept = call("hand over moments", 60, [&] { return client_->hand_over(payload); });
    spdlog::info("node {}: handed over the AdamW moments of the {} experts it loses in "
                 "ownership epoch {} ({} bytes, step {})", node, kept, epoch,
                 payload.total_bytes(), t.state().step);
    return moments_record(t, m);
  } catch (const NodeStopped&) {
    throw;
  } catch (const std::exception& e) {
    spdlog::warn("node {}: the AdamW moments of the {} experts it loses in ownership epoch {} "
                 "were not handed over ({}); their new owners start them at zero", node,
                 lost.size(), epoch, e.what());
    return {{"error", e.what()}};
  }
}

ExpertMoments SyncNode::fetch_handed_moments(const Trainer& t, const Ownership& next,
                                             int64_t epoch) {
  const int64_t node = client_->id().node_id;
  const auto before = trainable_expert_table(t.config(), t.ownership(), node);
  const auto gained = experts_of(trainable_expert_table(t.config(), next, node), &before);
  if (gained.empty() || epoch <= 0) return {};
  // What the gained experts' moments can take on the wire: 8 bytes a value, and the header.
  uint64_t max_bytes = 64 << 10;
  std::set<std::string> names;
  for (const auto& [l, e] : gained)
    for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
      const std::string name = expert_param_name(l, e, proj);
      names.insert(name);
      max_bytes += static_cast<uint64_t>(t.registry().find(name)->tensor.numel()) * 8 + 16 +
                   4 * (name.size() + 128);
    }
  try {
    const std::string bytes =
        call("fetch moments", 120, [&] { return client_->fetch_moments(epoch, max_bytes); });
    ExpertMoments m = moments_from_tensors(
        safetensors_parse(bytes, nullptr, "handed moments"),
        fmt::format("node {}: the moments of epoch {}", node, epoch));
    for (auto it = m.by_name.begin(); it != m.by_name.end();)  // only what this node gains
      it = names.count(it->first) ? std::next(it) : m.by_name.erase(it);
    spdlog::info("node {}: ownership epoch {}: moments handed over for {} of the {} experts it "
                 "gains{}", node, epoch, m.by_name.size() / 3, gained.size(),
                 m.by_name.size() / 3 < gained.size()
                     ? " (the others start at zero moments with a re-warm-up)" : "");
    return m;
  } catch (const NodeStopped&) {
    throw;
  } catch (const std::exception& e) {
    spdlog::warn("node {}: could not fetch the moments handed over in ownership epoch {} ({}); "
                 "the experts it gains start at zero moments with a re-warm-up", node, epoch,
                 e.what());
    return {};
  }
}

nlohmann::json moments_record(const Trainer& t, const ExpertMoments& m) {
  // Per expert "layer:expert": the digest of its three projections' moments (an expert may
  // come from one node and go to another, so the sides compare expert by expert).
  std::map<std::string, ExpertMoments> by_expert;
  double second = 0;
  for (const auto& [name, e] : m.by_name) {
    const RegistryEntry* r = t.registry().find(name);
    if (!r) continue;
    by_expert[fmt::format("{}:{}", r->layer, r->expert)].by_name[name] = e;
    second += e.exp_avg_sq.to(torch::kCPU, torch::kDouble).sum().item<double>();
  }
  nlohmann::json digests = nlohmann::json::object();
  for (const auto& [key, one] : by_expert) digests[key] = moments_sha256(one);
  return {{"experts", by_expert.size()}, {"tensors", m.by_name.size()},
          {"sha256", moments_sha256(m)}, {"by_expert", digests}, {"exp_avg_sq_sum", second}};
}

nlohmann::json handed_record(const Trainer& t, const ExpertMoments& handed) {
  std::set<std::pair<int64_t, int64_t>> experts;
  for (const auto& [name, m] : handed.by_name) {
    const RegistryEntry* r = t.registry().find(name);
    if (r) experts.insert({r->layer, r->expert});
  }
  return moments_record(t, t.expert_moments({experts.begin(), experts.end()}));
}

}  // namespace spes::sync
