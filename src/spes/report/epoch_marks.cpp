// The starts of a run's ownership epochs (see epoch_marks.h).
#include "spes/report/epoch_marks.h"

#include <fmt/format.h>

#include <set>

namespace spes::report {

namespace {

std::string joined(const std::set<int64_t>& ids) {
  std::string s;
  for (int64_t i : ids) s += (s.empty() ? "" : ",") + std::to_string(i);
  return s;
}

// "epoch 1: 2 experts 3->0,1"
std::string epoch_label(int64_t epoch, const nlohmann::json& handoffs) {
  std::set<int64_t> from, to;
  for (const auto& h : handoffs) {
    from.insert(h.value("from", int64_t{-1}));
    to.insert(h.value("to", int64_t{-1}));
  }
  return fmt::format("epoch {}: {} expert{} {}->{}", epoch, handoffs.size(),
                     handoffs.size() == 1 ? "" : "s", joined(from), joined(to));
}

}  // namespace

std::vector<EpochStart> epoch_starts(const RunData& run) {
  std::vector<EpochStart> out;
  if (!run.cluster) return out;
  const auto tokens = cluster_tokens_by_step(run);
  for (const auto& r : run.rounds) {
    if (!r.contains("ownership_next") || !r["ownership_next"].is_object()) continue;
    const nlohmann::json handoffs = r.value("handoffs", nlohmann::json::array());
    EpochStart e;
    e.epoch = r["ownership_next"].value("epoch", int64_t{0});
    e.round = r["ownership_next"].value("from_round", r.value("round", int64_t{0}) + 1);
    e.step = r.value("step", int64_t{0});
    const auto it = tokens.find(e.step);
    if (it != tokens.end()) e.tokens = it->second;
    e.label = epoch_label(e.epoch, handoffs);
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace spes::report
