// With spes_config.overlap a node's sync round runs in the background while training goes on
// (docs/PROTOCOL.md, "Overlap"). Starting one copies the live weights to the CPU (every tensor,
// its own dtype) and the trainable tensors as uploaded, S (their device and dtype), then runs
// the round's exchange with the server on the copy in a thread: the copy is uploaded, and ends
// as the published model P, its digest checked. apply() then sets the live trainable tensors
// to P + (live - S), keeping the steps trained since the upload, and the frozen ones to P.
// Memory while a round is in flight: one CPU copy of the model plus one of the trainable
// tensors, allocated once per node: a finished round hands them to the next (InFlightBuffers),
// so a round costs two copies and no allocation or page faults on the training thread.
// Leaves out: the exchange itself, catch-ups and when to apply (node.cpp).
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <future>
#include <optional>
#include <string>
#include <vector>

#include "spes/model/registry.h"
#include "spes/sync/wire/protocol.h"

namespace spes::sync {

// What one round's exchange with the server gave: the sync record of a round published with
// this node's upload, or the round from which the node must catch up (and why).
struct RoundExchange {
  nlohmann::json record;
  int64_t catch_up_round = -1;
  std::string why;
  // The map of the next round, as the published round came with it (the node changes to it
  // when it applies the round).
  OwnershipMap ownership;
  bool needs_catch_up() const { return catch_up_round >= 0; }
};

// The memory a round in flight works in: the CPU copy of the model and S. Empty, or taken from
// a finished round of the same registry (tensors of another shape or dtype are not reused).
struct InFlightBuffers {
  std::optional<ParamRegistry> copy;
  std::vector<torch::Tensor> uploaded;
};

class RoundInFlight {
 public:
  using Exchange = std::function<RoundExchange(const ParamRegistry& copy)>;
  // The round `round` uploaded after step `step`, applied after step `deadline` at the latest;
  // its copy and S go into `reuse` where they fit.
  RoundInFlight(const ParamRegistry& live, int64_t round, int64_t step, int64_t deadline,
                Exchange exchange, InFlightBuffers reuse = {});
  ~RoundInFlight();  // waits for the exchange to end
  RoundInFlight(const RoundInFlight&) = delete;
  RoundInFlight& operator=(const RoundInFlight&) = delete;

  int64_t round() const { return round_; }
  int64_t step() const { return step_; }
  int64_t deadline() const { return deadline_; }
  bool ready() const;
  // Waits for the exchange and returns what it gave (once); rethrows its failure.
  RoundExchange wait();
  // After wait() gave a published round (else throws): live trainable = P + (live - S), live
  // frozen = P.
  void apply(const ParamRegistry& live) const;
  // After wait() gave a published round: the copy, which holds that round's model exactly.
  const ParamRegistry& published() const { return copy_; }
  // Bytes held for the round (the CPU copy and S).
  uint64_t bytes() const;
  // After wait(): the copy and S, for the next round; this round can no longer be applied.
  InFlightBuffers release();

 private:
  int64_t round_, step_, deadline_;
  ParamRegistry copy_;
  std::vector<torch::Tensor> uploaded_;  // S, per trainable entry in registry order
  std::future<RoundExchange> result_;
  bool published_ = false;  // wait() gave a published round
};

}  // namespace spes::sync
