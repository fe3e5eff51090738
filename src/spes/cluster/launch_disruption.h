// A scripted disruption of a local cluster, for demonstrations and experiments of elastic
// expert ownership (docs/PROTOCOL.md "Ownership epochs"): `spes launch --kill-node I
// --at-round R` SIGKILLs node I once the server has published round R (a machine that
// vanished: no Leave, its AdamW moments lost); `--depart-node I --at-round R` starts node I with
// `spes node --depart` and sends it SIGTERM then (a volunteer leaving for good: it finishes its
// step, writes its checkpoint and sends a departing Leave). Either way the node's exit is
// expected and the rest of the cluster runs on; the summary checks the node's digests up to
// the round it left in. `--add-node-at-round R` is the other way round: one more node (the next
// id, `spes node --join-new`) starts once the server has published round R, and takes experts
// from the most loaded nodes at the next boundary.
#pragma once
#include <cstdint>
#include <string>

namespace spes {

struct NodeDisruption {
  enum class Kind { None, Kill, Depart };
  Kind kind = Kind::None;
  int64_t node = -1;
  int64_t at_round = 0;  // after the server published this round

  bool active() const { return kind != Kind::None; }
  // "node 3 killed (SIGKILL) after round 4", for logs and the summary.
  std::string describe() const;
  // Throws unless the node is one of `nodes` and the round one of the run's `rounds` but its
  // last (there must be rounds left to run without it).
  void check(int64_t nodes, int64_t rounds) const;
};

// A node that arrives mid-run: id `node` (the cluster's size before it), started once the
// server has published `after_round` (0: none).
struct NodeArrival {
  int64_t node = -1;
  int64_t after_round = 0;

  bool active() const { return after_round > 0; }
  // "node 4 joins (--join-new) after round 8", for logs and the summary.
  std::string describe() const;
  // Throws unless the round is one of the run's `rounds` but its last (the new node must have
  // rounds to train in).
  void check(int64_t rounds) const;
};

// Watches the server's published round (its state.json) and says, once, when it reached
// `at_round` (0: never).
class RoundWatch {
 public:
  RoundWatch(std::string server_dir, int64_t at_round);
  // True the first time the server's published round is at least at_round; reads the
  // server's state at most every 200 ms.
  bool due();

 private:
  std::string server_dir_;
  int64_t at_round_ = 0;
  bool fired_ = false;
  int64_t last_check_ms_ = 0;
};

// The round the server in `server_dir` has published last (0 before any, or while its state
// cannot be read).
int64_t published_round_of(const std::string& server_dir);

}  // namespace spes
