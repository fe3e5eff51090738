// The sync server's state on disk in its directory DIR, written so that a crash at any moment
// loses nothing and a restarted server continues from the latest published round: with
// compression the round's delta from the previous round (delta.safetensors, written while it
// is computed: round/delta_file.h), the round's diloco momentum (momentum-<r>.safetensors), the
// published model (published.safetensors, authoritative on restart; written past the page
// cache), then state.json (the round's record and the run's identity), each written to a
// temporary name, fsynced and renamed before the round is published; with keep_uploads also
// copies (hard links) under rounds/<r>/. What need not delay a publication runs on a
// background thread while nodes download, always before the next round is persisted: removing
// the replaced model file, the staged uploads and the previous momentum, and saving the drift
// window. On restart, checks that DIR holds the same run and loads the model from it.
// Leaves out: rounds.jsonl (round_log.h) and staged uploads (upload_staging.h).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "spes/common/background_queue.h"
#include "spes/io/config.h"
#include "spes/io/run_layout.h"
#include "spes/sync/round/aggregate.h"
#include "spes/sync/round/published_delta.h"

namespace spes::sync {

// The latest published round, as the server serves and persists it.
struct PublishedRound {
  int64_t round = 0, step = 0;
  std::string sha256;            // of the published weights
  double alpha = 0;              // merge coefficient (0: no merge)
  bool merged = false;
  std::vector<int64_t> nodes;    // nodes whose uploads the round used
};

class RoundStore {
 public:
  // Creates DIR and removes what a crash of the server left there (temporary files, partial
  // kept uploads). `incarnation`: the server's, recorded in state.json.
  RoundStore(const Config& cfg, std::string dir, bool keep_copies, SyncModel& model,
             uint64_t incarnation);
  // With a valid DIR/state.json: checks that it holds this run (mode, model, ownership), loads
  // published.safetensors into the model (and diloco's momentum) and returns the round; a
  // round's record comes back only if state.json describes that round. Nothing: no state.json.
  // Throws with the fix when DIR is corrupt or holds another run.
  std::optional<PublishedRound> resume();
  // Opens the delta file of round `round` (from `from_round`) with `layout`
  // (round/published_delta.h: delta_layout) for quantise_publication; nothing (logged: the
  // round's nodes then get full tensors) when it cannot be created.
  std::unique_ptr<DeltaFileWriter> begin_delta(const PublishedDelta& layout, int64_t round,
                                               int64_t from_round) const;
  // Completes it as DIR/delta.safetensors, before the round's model is persisted; false
  // (logged; nodes get full tensors for the round) when it could not be written.
  bool commit_delta(DeltaFileWriter& file, const DeltaRecord& record) const;
  // Persists `p` (the model as it is now) with its rounds.jsonl line kept in state.json, after
  // the previous round's background work; its cleanup follows in the background. Returns the
  // weights' digest: p.sha256, or when that is empty the digest computed while the model file
  // is written. Throws (nothing replaced) when the published model cannot be written; once it
  // is in place (the commit point) a failure to update state.json is logged, not thrown.
  std::string persist(const PublishedRound& p, const nlohmann::json& line);
  // Runs `job` on the background thread after the work already queued (`what` names it in the
  // log if it fails): cleanup that must not delay a publication.
  void defer(std::string what, std::function<void()> job);
  // Blocks until all background work so far has run (on shutdown; tests).
  void flush();
  // The delta file of round `p` (same round and digest) when DIR holds one, else nothing (a
  // restarted server then serves full tensors once).
  std::optional<DeltaRecord> load_delta(const PublishedRound& p) const;
  std::string delta_path() const { return run_layout::published_delta(dir_); }
  std::string residual_path() const { return run_layout::sparse_residual(dir_); }
  // The update bounds' drift window after round `p` (UpdateBounds::to_json), saved atomically
  // beside the round in the background; a failure is logged (a restart then starts the window
  // empty).
  void save_drift_window(const PublishedRound& p, const nlohmann::json& window);
  // The window saved with round `p` (same round and model digest), else null.
  nlohmann::json load_drift_window(const PublishedRound& p) const;
  // The rounds.jsonl line that state.json keeps (null if none).
  nlohmann::json saved_line() const;
  const std::string& dir() const { return dir_; }
  std::string published_path() const { return run_layout::published(dir_); }

 private:
  std::string momentum_path(int64_t round) const;
  void remove_leftovers() const;
  // resume()'s steps: state.json, checked to describe this run; the published model loaded
  // from its file (returns the file's metadata); its digest checked (a file of protocols 1-4
  // named by today's digest); the outer step's momentum.
  nlohmann::json read_state_for_this_run() const;
  Metadata load_published_model();
  std::string check_published_digest(const std::string& written) const;
  void load_momentum(int64_t round);
  // persist()'s steps: the momentum, the published model (returns its digest; `replaced`: the
  // file it replaced, set aside), state.json, the kept copies of --keep-uploads.
  void write_momentum(int64_t round);
  std::string write_published_model(const PublishedRound& p, std::string* replaced);
  void write_state(const PublishedRound& p, const std::string& sha, const nlohmann::json& line);
  void keep_round_copies(int64_t round, bool outer);
  const Config& cfg_;
  std::string dir_;
  bool keep_copies_;
  SyncModel& model_;
  uint64_t incarnation_;
  // Last member: destroyed first, running what is queued while the rest is still alive.
  BackgroundQueue background_{"sync server: background persistence"};
};

}  // namespace spes::sync
