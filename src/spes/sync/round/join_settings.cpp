// The must-match table of a Join and its check (see join_settings.h).
#include "spes/sync/round/join_settings.h"

#include "spes/common/strings.h"
#include "spes/model/ownership.h"
#include "spes/sync/round/plan.h"
#include "spes/sync/wire/protocol.h"
#include "spes/sync/wire/topk_codec.h"

namespace spes::sync {

namespace {
constexpr std::string_view kSameSpesConfig =
    "the server and every node must use the same spes_config";
constexpr size_t kShownValueBytes = 80;  // a value from the network is shown cut to this

// A top-k setting: its exact value with compression topk, "unused" otherwise (so that nodes
// of an int8 run do not have to agree on settings they never use).
std::string topk_setting(const JoinSources& s, double value) {
  if (s.cfg.spes_config.transfer.compression != Compression::Topk) return "unused";
  return fmt::format("{:.17g}", value);
}
}  // namespace

const std::array<JoinSetting, 14> kJoinSettings{{
    {"spes_config.mode", "spes_config.mode",
     [](const JoinSources& s) { return s.cfg.spes_config.mode.name(); }, kSameSpesConfig},
    {"spes_config.num_peers", "spes_config.num_peers",
     [](const JoinSources& s) { return std::to_string(s.cfg.spes_config.num_peers); },
     kSameSpesConfig},
    {"spes_config.sync_steps", "spes_config.sync_steps",
     [](const JoinSources& s) { return std::to_string(s.cfg.spes_config.sync_steps); },
     kSameSpesConfig},
    {"spes_config.transfer_dtype", "spes_config.transfer_dtype",
     [](const JoinSources& s) { return s.cfg.spes_config.transfer.dtype.name(); },
     kSameSpesConfig},
    {"spes_config.compression", "spes_config.compression",
     [](const JoinSources& s) { return s.cfg.spes_config.transfer.compression.name(); },
     kSameSpesConfig},
    {"spes_config.topk_density", "spes_config.topk_density",
     [](const JoinSources& s) {
       return topk_setting(s, s.cfg.spes_config.transfer.topk_density);
     },
     kSameSpesConfig},
    {"spes_config.topk_bits", "spes_config.topk_bits",
     [](const JoinSources& s) {
       return topk_setting(s, static_cast<double>(s.cfg.spes_config.transfer.topk_bits));
     },
     kSameSpesConfig},
    {"spes_config.topk_decay", "spes_config.topk_decay",
     [](const JoinSources& s) { return topk_setting(s, s.cfg.spes_config.transfer.topk_decay); },
     kSameSpesConfig},
    {"spes_config.topk_down_density", "spes_config.topk_down_density",
     [](const JoinSources& s) {
       return topk_setting(s, topk_published_params(s.cfg.spes_config.transfer).density);
     },
     kSameSpesConfig},
    {"spes_config.reassign_after_rounds", "spes_config.reassign_after_rounds",
     [](const JoinSources& s) {
       return std::to_string(s.cfg.spes_config.elastic.reassign_after_rounds);
     },
     kSameSpesConfig},
    {"spes_config.max_nodes", "spes_config.max_nodes (node ids the run admits)",
     [](const JoinSources& s) { return std::to_string(s.cfg.spes_config.node_slots()); },
     "the server and every node, arrivals included, must use the same spes_config.max_nodes "
     "(0 or absent: num_peers)"},
    {"ownership", "expert ownership map",
     [](const JoinSources& s) { return Ownership::from_config(s.cfg).fingerprint(); },
     "both must build it from the same spes_config.expert_owners / num_peers / "
     "num_train_experts_per_node"},
    {"model", "model (tensor names, shapes, roles and dtypes)",
     [](const JoinSources& s) { return s.model_fingerprint; }, "use the same model config"},
    {"model_config", "the model section of its config",
     [](const JoinSources& s) { return model_config_sha256(s.cfg); },
     "use the same model config (e.g. moe_top_k, rope_theta)"},
}};

JoinSettingValues join_setting_values(const JoinSources& sources) {
  JoinSettingValues out;
  for (const JoinSetting& row : kJoinSettings)
    out.emplace(std::string(row.key), row.value(sources));
  return out;
}

void check_join_settings(int64_t node, const JoinSettingValues& declared,
                         const JoinSettingValues& server) {
  for (const JoinSetting& row : kJoinSettings) {
    const std::string key(row.key);
    const auto it = declared.find(key);
    if (it == declared.end())
      sync_fail(SyncErrc::FailedPrecondition, "node {} does not declare {} (it runs another "
                "version of spes?); the server and every node must run the same spes", node,
                key);
    const std::string& mine = server.at(key);
    if (it->second != mine)
      sync_fail(SyncErrc::FailedPrecondition, "node {}: {} differs from the server's ({}={} "
                "on the node, {} on the server); {}", node, row.what, key,
                printable(it->second, kShownValueBytes), mine, row.fix);
  }
  for (const auto& [key, value] : declared)
    if (!server.count(key))
      sync_fail(SyncErrc::FailedPrecondition, "node {} declares the setting '{}', which this "
                "server does not know (it runs another version of spes?); the server and "
                "every node must run the same spes", node, printable(key, kShownValueBytes));
}

}  // namespace spes::sync
