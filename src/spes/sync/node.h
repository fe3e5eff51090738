// A SPES node's sync client as a Trainer StepObserver. on_start: connect (retrying with
// backoff while the server comes up), join with the node's fingerprints, load the server's
// current model (so nodes need not share a seed). Every sync_steps steps, after the optimizer
// step: upload the trainable tensors, long-poll until the round is published, download what the
// node lacks, check that its weights now hash to the published digest, and report
// {"sync": {round, bytes_up, bytes_down, model_sha256, ...}} for the metrics line. Optimizer
// moments are kept (reference behaviour). on_finish: leave. Leaves out: rejoining after a
// crash and resuming transfers (reliability work).
#pragma once
#include <nlohmann/json.hpp>

#include <memory>
#include <string>

#include "spes/sync/protocol.h"
#include "spes/train/trainer.h"

namespace spes::sync {

class SyncClient;

struct NodeOptions {
  std::string server = "127.0.0.1:50551";  // host:port of `spes serve`
  double connect_timeout_s = 120;          // keep retrying this long while the server is down
  double round_wait_s = 0;                 // give up waiting for a round (0: max(600, 2 x
                                           // spes_config.round_timeout))
  std::string auth_token;                  // reserved (not checked by the server yet)
};

class SyncNode : public StepObserver {
 public:
  explicit SyncNode(NodeOptions opts);
  ~SyncNode() override;
  void on_start(Trainer& t) override;
  nlohmann::json after_step(Trainer& t, int64_t step) override;
  void on_finish(Trainer& t) override;

 private:
  nlohmann::json sync_round(Trainer& t, int64_t step);

  NodeOptions opts_;
  std::unique_ptr<SyncClient> client_;
  nlohmann::json join_record_;
  int64_t tokens_at_sync_ = 0;
  std::string frozen_sha_;
};

// SHA-256 over the names and fp32 bytes of the registry's frozen (non-trainable) tensors.
std::string frozen_weights_sha256(const ParamRegistry& registry);

}  // namespace spes::sync
