// A SPES node's sync state in its checkpoint (see node.h; docs/PROTOCOL.md, "What resets"):
// with compression the base of the next delta and the error feedback (int8's residual, top-k's
// accumulator) as of the last published model the node took, saved with the rest of the
// checkpoint (sync.safetensors, and its round and digest in state.json's "extra"), checked and
// taken back by a node that continues its checkpoint.
#include <spdlog/spdlog.h>

#include <algorithm>

#include "spes/common/error.h"
#include "spes/sync/node/client.h"
#include "spes/sync/node/node.h"
#include "spes/sync/round/round_clock.h"

namespace spes::sync {

void SyncNode::save_state(TrainState& s) {
  if (s.extra.is_object()) s.extra.erase("sync");
  s.sync_tensors.clear();
  if (!delta_ || !delta_->enabled()) return;
  DeltaUpload::SavedState st = delta_->saved_state();
  if (st.round < 0) return;  // no published model taken yet
  if (!s.extra.is_object()) s.extra = nlohmann::json::object();
  s.extra["sync"] = {{"compression", compression_name(delta_->compression())},
                     {"round", st.round},
                     {"model_sha256", st.model_sha256}};
  s.sync_tensors = std::move(st.tensors);
}

std::string SyncNode::sync_state_problem(const Trainer& t, int64_t round,
                                         const std::string& model_sha256) const {
  const nlohmann::json& x = t.state().extra;
  if (t.state().sync_tensors.empty() || !x.is_object() || !x.contains("sync"))
    return "the checkpoint holds no sync state (sync.safetensors)";
  const nlohmann::json& m = x["sync"];
  if (!m.is_object() || !m.value("compression", nlohmann::json()).is_string() ||
      !m.value("round", nlohmann::json()).is_number_integer() ||
      !m.value("model_sha256", nlohmann::json()).is_string())
    return "its sync state in state.json lacks compression, round or model_sha256";
  const std::string c = m["compression"].get<std::string>();
  if (c != compression_name(delta_->compression()))
    return fmt::format("its sync state is of compression {}", c);
  if (m["round"].get<int64_t>() != round)
    return fmt::format("its sync state belongs to round {}, not {}", m["round"].get<int64_t>(),
                       round);
  if (!model_sha256.empty() && m["model_sha256"].get<std::string>() != model_sha256)
    return fmt::format("its sync state's base is not the published model of round {}", round);
  return "";
}

void SyncNode::restore_sync_state(Trainer& t) {
  const nlohmann::json& m = t.state().extra["sync"];
  const DeltaUpload::SavedState s{m["round"].get<int64_t>(),
                                  m["model_sha256"].get<std::string>(), t.state().sync_tensors};
  try {
    delta_->restore_state(t.registry(), s);
  } catch (const Error& e) {
    fail("node {}: its checkpoint's sync state (sync.safetensors) does not match the model: {}. "
         "To continue without it, remove that file from the checkpoint: the node then takes the "
         "published model (the steps since round {} are lost)",
         client_->id().node_id, e.what(), s.round);
  }
  held_round_ = s.round;
  spdlog::info("node {}: took back its sync state of round {} ({} tensors: base and {} "
               "feedback)", client_->id().node_id, s.round, s.tensors.size(),
               compression_name(delta_->compression()));
}

bool SyncNode::replays_upload(const Trainer& t, const JoinResult& jr) const {
  if (!delta_->enabled()) return false;
  const int64_t r = jr.published_round, node = client_->id().node_id;
  const auto& used = jr.published_nodes;
  return t.state().sync_round == r - 1 &&
         t.state().step == RoundClock(t.config()).step_of(r) &&
         std::find(used.begin(), used.end(), node) != used.end() &&
         sync_state_problem(t, r - 1, "").empty();
}

void SyncNode::replay_upload(Trainer& t, const JoinResult& jr) {
  restore_sync_state(t);
  const ParamRegistry& reg = t.registry();
  const UploadMeta meta{reg.node_id(), jr.published_round, t.state().step, 0,
                        client_->id().incarnation, reg.fingerprint()};
  delta_->encode(reg, meta);  // the payload itself is in the published round already
  spdlog::info("node {}: its checkpoint was written at sync step {} after its upload to round "
               "{}, which was published with it: encoded that upload again to keep what it "
               "did not send", client_->id().node_id, t.state().step, jr.published_round);
}

}  // namespace spes::sync
