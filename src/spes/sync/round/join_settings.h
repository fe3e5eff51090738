// The settings a joining node must share with the server, in one table: each row names the
// setting (its key in the Join message's `settings` map and in a refusal), how its value is
// read from a config and model, and what a user does when a node and the server disagree.
// The node's declaration (node_join_info), the message (client.cpp, rpc_calls.cpp copy the map
// as it is) and the server's check (Membership::join) all come from this table, so a new
// must-match setting is one row. Leaves out: the node's identity, its step and the protocol
// version, which travel as fields of their own (protocol.h, JoinInfo).
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "spes/io/config.h"

namespace spes::sync {

// What a row reads its value from: the config, and the model's fingerprint (tensor names,
// shapes, roles, dtypes: ParamRegistry::fingerprint on a node, SyncModel's on the server).
struct JoinSources {
  const Config& cfg;
  const std::string& model_fingerprint;
};

struct JoinSetting {
  std::string_view key;    // in the Join message and in refusals
  std::string_view what;   // "<what> differs from the server's"
  std::string (*value)(const JoinSources&);
  std::string_view fix;    // what the user does about it
};

// Every setting a node must share with the server (compared as text, exactly).
extern const std::array<JoinSetting, 14> kJoinSettings;

// key -> value of every row, as this side sees them.
using JoinSettingValues = std::map<std::string, std::string>;
JoinSettingValues join_setting_values(const JoinSources& sources);

// Refuses (SyncError FailedPrecondition, naming the setting, both values and the fix) a node
// whose declared values miss a row, add an unknown key or differ from the server's.
void check_join_settings(int64_t node, const JoinSettingValues& declared,
                         const JoinSettingValues& server);

}  // namespace spes::sync
