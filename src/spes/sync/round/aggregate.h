// One SPES round, tensor by tensor by name, in one API that the sync server and
// `spes aggregate` both run (so an offline round reproduces a published model bit for bit):
//   shared tensor (and, in fedavg/diloco, every tensor): weighted mean over the nodes present
//     (weights: 1 each, or the tokens each node reports), or, with spes_config.aggregation,
//     the coordinate-wise median or trimmed mean of the nodes' values (unweighted);
//   expert tensor in mode spes: its owner's copy (owner absent: the last published value);
//   diloco (and spes with outer_step, on the shared tensors): outer Nesterov step on the
//   averaged pseudo-gradient, momentum kept here;
//   then, in mode spes at a merge point, expert merging (merge.h);
//   then rounding to the transfer dtype, so the published model is exactly what nodes receive.
// Memory: the published model plus one running sum per averaged tensor (S, the shared tensors
// in mode spes), never N uploads (median and trimmed_mean hold each node's averaged tensors:
// N x S): uploads are folded one node at a time, piece by piece, in
// ascending node order (floating-point sums depend on order; a fixed order makes them
// reproducible); experts' owner copies are read back from the staged upload files at finish.
// Leaves out: transport, staging of uploads on disk, persistence (round_state.h).
#pragma once
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "spes/io/config.h"
#include "spes/io/safetensors.h"
#include "spes/model/initial_weights.h"
#include "spes/model/registry.h"
#include "spes/model/transformer.h"
#include "spes/sync/round/merge.h"
#include "spes/sync/round/plan.h"
#include "spes/sync/round/sparse_publication.h"

namespace spes::sync {

// The server's model: layout, published weights (initialised from cfg.seed, or the initial
// weights of model.init_checkpoint handed down by the command), diloco momentum.
class SyncModel {
 public:
  explicit SyncModel(const Config& cfg, std::optional<InitialWeights> initial = std::nullopt);
  ~SyncModel();

  const Config& config() const { return cfg_; }
  // The plan of the round being collected (its map: ownership epoch plan().ownership_epoch()).
  const RoundPlan& plan() const { return *plan_; }
  // The plan whose uploads made the latest published round: plan() except between the
  // publication of a round that introduced a new ownership epoch and the next publication.
  // Downloads of the published round follow it (a node skips its own experts of that round).
  const RoundPlan& published_plan() const { return published_plan_ ? *published_plan_ : *plan_; }
  // From the next round on `ownership` (epoch `epoch`): plan() becomes its plan (same object,
  // so references to it stay valid), published_plan() the previous one.
  void change_ownership(const Ownership& ownership, int64_t epoch);
  // A round was published with plan(): published_plan() is plan() again.
  void published_with_current_plan() { published_plan_.reset(); }
  // Published tensors in model order (the order of plan().tensors()).
  const std::vector<torch::Tensor>& tensors() const { return tensors_; }
  NamedTensors named() const;
  // Replaces the published weights (every tensor required; shapes and finiteness checked).
  void load(const NamedTensors& tensors, const std::string& origin);
  // Digest of the published weights: equal to ParamRegistry::weights_sha256 on a node
  // holding the same weights.
  std::string weights_sha256() const;
  // The digest of sync protocols 1-4 (ParamRegistry::flat_weights_sha256), for resuming a
  // directory they wrote.
  std::string flat_weights_sha256() const;
  std::string model_fingerprint() const;
  std::string ownership_fingerprint() const { return ownership_fingerprint_; }

  // diloco outer momentum, one tensor per model tensor (undefined until first used).
  std::vector<torch::Tensor>& momentum() { return momentum_; }
  NamedTensors momentum_named() const;  // defined entries only
  void load_momentum(const NamedTensors& tensors, const std::string& origin);
  // compression: topk: the published change's encoder and its dense residual R
  // (sparse_publication.h; null otherwise), carried from round to round.
  SparsePublisher* sparse() { return sparse_.get(); }
  // R to `path` for the published model of (round, model_sha256), or back from it (false, R
  // = 0, when the file is missing, damaged or of another round). No-ops without topk.
  void save_sparse_residual(const std::string& path, int64_t round,
                            const std::string& model_sha256) const;
  bool load_sparse_residual(const std::string& path, int64_t round,
                            const std::string& model_sha256);

 private:
  Config cfg_;
  std::unique_ptr<Transformer> model_;
  std::unique_ptr<ParamRegistry> registry_;
  std::unique_ptr<RoundPlan> plan_;
  std::unique_ptr<RoundPlan> published_plan_;  // null: plan_
  std::vector<torch::Tensor> tensors_;
  std::vector<torch::Tensor> momentum_;
  std::unique_ptr<SparsePublisher> sparse_;
  std::string ownership_fingerprint_;
};

// Where one tensor's q (and, with int8, its scales) lies in a staged compressed upload file:
// absolute byte offsets of the values.
struct StagedDelta {
  std::string file;
  uint64_t q_at = 0, scales_at = 0;
  uint64_t bytes = 0;  // the q entry's length (topk: the payload's, which varies)
};

struct RoundOutcome {
  int64_t round = 0, step = 0;
  std::vector<int64_t> nodes;      // nodes folded, ascending
  std::vector<int64_t> tokens;     // tokens each reported
  std::vector<double> weights;     // weight each got
  double alpha = 0;                // merge coefficient (0: no merge)
  bool merged = false;
  std::vector<double> gate_cos;         // per layer: mean pairwise cosine of gate_proj, published
  std::vector<double> gate_cos_before;  // per layer, pre-merge (merge rounds only)
  // (layer, expert) that merging did not take from (exclude_from_merging), merge rounds only.
  std::vector<std::pair<int64_t, int64_t>> merge_excluded;
  // Per model tensor: ||published after - published before|| from the combination and outer
  // step (merging excluded); 0 for tensors nobody uploaded. For the drift bound.
  std::vector<double> change;
  // With compression: per owner-copied tensor read back from its owner's upload (model index),
  // where the q the owner sent lies in that upload's file: the published value is
  // P_prev + deq(q) exactly, so a compressed download can carry this q again
  // (round/published_delta.h reads it back; the file must exist until then). Empty without
  // compression.
  std::map<size_t, StagedDelta> owner_deltas;
  // With the outer step (mode diloco, or spes with outer_step): whether its momentum points
  // where the nodes went. Over every tensor the step moved, this round's outer change
  // delta = published before - average and the momentum m before this round's update:
  // cos(delta, m) (NaN in the first round, m still zero, or without the outer step), ||delta||
  // and ||m||. Near 1: consecutive rounds agree and the momentum extrapolates; near 0 or below:
  // it adds old directions.
  double outer_momentum_cos = NAN;
  double outer_change_norm = NAN, outer_momentum_norm = NAN;
};

class RoundAggregator {
 public:
  explicit RoundAggregator(SyncModel& model);
  void begin(int64_t round, int64_t step);
  bool active() const { return active_; }
  const SyncModel& model() const { return model_; }
  int64_t round() const { return round_; }
  int64_t step() const { return step_; }
  // Folds one node's upload: begin_node, then its tensors in model order (whole with add(), or
  // as consecutive runs with add_run()), then end_node(). Nodes come in ascending id order.
  // `tokens`: what the node trained this round. With `source_file` (the upload as staged on
  // disk), owner-copied tensors are not held in memory: finish() reads them from the file
  // again, so the file must exist until then.
  void begin_node(int64_t node, int64_t tokens, const std::string& source_file = "");
  void add(const std::string& name, const torch::Tensor& value);
  void add_run(const std::string& name, int64_t first, const torch::Tensor& run, bool last);
  // In place of add() for an owner-copied tensor of a node folded with `source_file`: finish()
  // reads its values from the file, so they need not be read here.
  void add_from_source(const std::string& name);
  void end_node();
  // Combines, applies the outer step and merging, rounds to the transfer dtype and writes the
  // result into the model's published tensors. The aggregator is then idle.
  RoundOutcome finish();
  // Drops a round in progress (nothing reaches the published model).
  void abort();
  // Experts (layer, expert) that this round's merging must not take from (merge.h,
  // merge_donors); set before finish(), cleared by begin().
  void exclude_from_merging(std::set<std::pair<int64_t, int64_t>> experts) {
    merge_excluded_ = std::move(experts);
  }

 private:
  // finish()'s steps: owner copies read back from the staged uploads (a compressed one
  // streamed and rebuilt against the published tensors), the averaged tensors combined (and
  // the outer step applied to them), the merging warm-up, rounding to the transfer dtype (and
  // the experts' gate cosines after it).
  void copy_owner_uploads();
  void copy_owner_delta_upload(int64_t node, const std::string& path);
  void combine_averaged_tensors();
  // DiLoCo's outer Nesterov step on tensor i's average `avg`, in place.
  void apply_outer_step(size_t i, torch::Tensor& avg);
  void merge_experts();
  void round_to_transfer_dtype();
  // With compression: notes where the raw q (or scales) of an owner copy lie in its file
  // (`header_bytes`: the file's header size).
  void keep_owner_delta(const RoundPlan& plan, int64_t node, const std::string& path,
                        uint64_t header_bytes, const StreamEntry& e);
  SyncModel& model_;
  MergeSchedule schedule_;
  bool active_ = false;
  int64_t round_ = 0, step_ = 0;
  int64_t node_ = -1, last_node_ = -1;
  double weight_ = 0;
  std::string source_;          // this node's upload file ("" : owner copies in memory)
  std::vector<size_t> expect_;  // this node's upload indices
  size_t got_ = 0;              // tensors of this node completed
  int64_t filled_ = 0;          // elements of the current tensor received
  std::vector<torch::Tensor> acc_;
  std::vector<double> wsum_;
  std::vector<int64_t> first_node_;  // node whose values initialised acc_[i]
  Aggregation statistic_;            // spes_config.aggregation
  std::vector<std::vector<torch::Tensor>> held_;  // median/trimmed_mean: [tensor][node k]
  std::vector<double> owner_change_sq_;           // owner copies read back in finish()
  std::vector<std::pair<int64_t, std::string>> owner_files_;  // read back in finish()
  // The outer step's sums over the round's tensors: delta.m, delta.delta, m.m (RoundOutcome).
  double outer_dot_ = 0, outer_delta_sq_ = 0, outer_m_sq_ = 0;
  RoundOutcome out_;
  std::set<std::pair<int64_t, int64_t>> merge_excluded_;
};

// Folds one upload file (a stream exactly as the server received it) into `agg`, with the
// server's checks (header against the plan, finite values), reading it piece by piece; owner
// copies are read back from the file by finish(). A compressed upload is rebuilt against the
// model's published tensors (the previous round's model) first. `expect_node` < 0: any node.
// `values_checked`: every value already passed check_upload_run as it arrived (the server's
// staged uploads, upload_staging.h), so the fold does not test them again; without
// compression it then reads only the sections of the averaged tensors.
UploadMeta fold_upload_file(RoundAggregator& agg, const RoundPlan& plan, const std::string& path,
                            int64_t expect_node = -1, bool values_checked = false);

// One offline round with the server's code: folds the upload files (any order given; folded in
// ascending node order, as the server does) into `model` (holding the previous published
// model and, for diloco, its momentum) for the sync at `step`.
RoundOutcome aggregate_offline(SyncModel& model, const std::vector<std::string>& uploads,
                               int64_t step);

// The published model as a stream: fp32 safetensors of every tensor in model order, with
// metadata naming the round, step and digest (no timestamps: identical rounds give identical
// bytes). `sha256`: model.weights_sha256(), computed once by the caller.
SafetensorsStreamWriter published_writer(const SyncModel& model, int64_t round, int64_t step,
                                         const std::string& sha256);

// Per layer: the experts' matrices of a model's tensor list (model order), for merging.
std::vector<std::vector<ExpertMats>> layer_experts(const RoundPlan& plan,
                                                   const std::vector<torch::Tensor>& tensors);

}  // namespace spes::sync
