// The AdamW moments a node departing for good hands over with its experts (issue 38, protocol
// 9; docs/PROTOCOL.md "Handing over the moments"): their safetensors form (format
// spes-moments-v1), the checks the server makes before it keeps them, what a receiver takes
// from them, and their digest (what a node's sync record shows of the moments it was handed).
// Stream tensors, per handed tensor NAME of the model (an expert's gate/up/down projection):
//   exp_avg/NAME, exp_avg_sq/NAME  F32, NAME's shape (the moments as fp32 values)
//   step/NAME, rewarm_from/NAME    I64 scalars (AdamW's step count of NAME; the step its
//                                  learning-rate re-warm-up started at, -1: none)
// and metadata format, node_id, ownership_epoch (the epoch the sender owned them under), step
// (the sender's optimizer step). Leaves out: transport (client.h, server.cpp) and where the
// server keeps them (server/handed_moments.h).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "spes/io/safetensors.h"
#include "spes/model/ownership.h"
#include "spes/sync/round/plan.h"
#include "spes/train/optimizer.h"

namespace spes::sync {

inline constexpr const char* kMomentsFormat = "spes-moments-v1";

// handover: "departing" (default: a node leaving for good hands over the experts it owns) or
// "lost" (protocol 10: a live node hands over the experts it lost to an arrival in epoch
// ownership_epoch + 1, right after applying that map).
inline constexpr const char* kHandoverLost = "lost";
struct MomentsMeta {
  int64_t node = -1, ownership_epoch = -1, step = -1;
  bool lost = false;
};
// Whether a handover's metadata says "lost" (anything else than absent/"departing"/"lost" is
// refused by check_moments_handoff).
bool moments_lost(const Metadata& md);

// The stream's tensors (names in ascending order) and metadata.
NamedTensors moments_tensors(const ExpertMoments& m);
Metadata moments_metadata(const MomentsMeta& meta);
// Back from the stream's tensors (a receiver's side: structure only, the trainer checks the
// values, train/ownership_change.h). Throws SyncError(InvalidArgument) naming what is wrong.
ExpertMoments moments_from_tensors(const NamedTensors& ts, const std::string& origin);

// The server's checks of a node's handover, against the plan of the round being collected
// (its epoch's map): metadata (format, node_id == `node`, ownership_epoch at most the plan's:
// a node may not have applied the newest map yet; step >= 0), then every tensor: a name of the form above, NAME an expert tensor that `node` trains
// under the plan's map, each such expert whole (its three projections, four entries each),
// dtype and shape, finite values, exp_avg_sq >= 0, step >= 0, rewarm_from >= -1; nothing else.
// Throws SyncError(InvalidArgument) naming the first problem; returns the experts handed
// ([layer, expert], ascending).
// A "lost" handover is checked against `previous`, the map of the epoch before the plan's
// (null at epoch 0: refused): its ownership_epoch must be the plan's - 1, and every expert one
// that `node` owned in `previous` and does not own under the plan's map (refused: an expert it
// never owned, one it still owns, another epoch).
std::vector<std::pair<int64_t, int64_t>> check_moments_handoff(const RoundPlan& plan,
                                                               const NamedTensors& ts,
                                                               const Metadata& md, int64_t node,
                                                               const std::string& origin,
                                                               const Ownership* previous = nullptr);
// The largest handover `node` can send under the plan's map: its experts' moments (8 bytes
// per value, 16 per scalar pair) and a header bound.
// With `previous` (the map of the epoch before the plan's), the experts `node` owned there
// count too (a "lost" handover).
uint64_t max_moments_bytes(const RoundPlan& plan, int64_t node,
                           const Ownership* previous = nullptr);

// SHA-256 over, for each tensor in name order, its name, step, rewarm_from and the hex
// SHA-256 of the fp32 bytes of exp_avg and of exp_avg_sq: equal digests, equal moments.
std::string moments_sha256(const ExpertMoments& m);

}  // namespace spes::sync
