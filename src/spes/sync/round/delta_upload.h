// A node's side of compressed uploads (spes_config.compression bf16 | int8; docs/PROTOCOL.md,
// "Compressed deltas"): it keeps `base`, its trainable tensors as of the last published model
// it holds, and the error-feedback residual `e` (both fp32 on CPU: 2 x the trainable
// parameters). At a sync: d = (W - base) + e; q = Q(d); e = d - deq(q); the upload carries q.
// When the round used the upload the node's trainable tensors become base + deq(q), exactly
// what the server rebuilt, before it downloads the rest. The node's checkpoint keeps base and
// residual as of the last published model it took (saved_state / restore_state), so a
// restarted node continues exactly. Leaves out: transport and the round logic (node.cpp), the
// codec (wire/delta_codec.h).
#pragma once
#include <torch/torch.h>

#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "spes/model/registry.h"
#include "spes/sync/round/plan.h"
#include "spes/sync/round/topk_feedback.h"
#include "spes/sync/wire/delta_codec.h"
#include "spes/sync/wire/framing.h"

namespace spes::sync {

// compression: topk: the residual is the TopkFeedback accumulator a (a = topk_decay x a +
// (W - base); the upload carries topk(a), one U8 payload per tensor; a keeps what was not sent),
// and the rebuilt tensors are base + deq(payload) by the same decode and rebuild as the server's.
// With `unsent_in_weights` (spes_config.topk_unsent_in_weights) the node trains on base + a
// after each round (add_unsent), so a round's change is W - base - a and the accumulator
// update a = topk_decay x a + (W - base - a) is the same rule: what the node has not sent is
// in its own weights instead of waiting, invisible to it, until it is sent.
class DeltaUpload {
 public:
  explicit DeltaUpload(Compression c, TopkParams topk = {}, double topk_decay = 1.0)
      : DeltaUpload(c, topk, topk_decay, topk) {}
  // `published`: the settings of the deltas the node downloads (topk_published_params).
  DeltaUpload(Compression c, TopkParams topk, double topk_decay, TopkParams published,
              bool unsent_in_weights = false)
      : c_(c), published_(published), topk_(topk, topk_decay),
        unsent_in_weights_(c == Compression::Topk && unsent_in_weights) {}
  bool unsent_in_weights() const { return unsent_in_weights_; }
  bool enabled() const { return c_ != Compression::None; }
  Compression compression() const { return c_; }
  const TopkParams& topk_params() const { return topk_.params(); }
  const TopkParams& topk_published_params() const { return published_; }
  // The node now holds the published model of `round` (digest `model_sha256`): base = its
  // trainable tensors. `reset_residual`: e = 0 (at the start and after a catch-up or any full
  // download: the residual belongs to a model the node no longer holds).
  void set_base(const ParamRegistry& reg, bool reset_residual, int64_t round = -1,
                const std::string& model_sha256 = "");
  // What a checkpoint keeps: base and residual (topk: the accumulator) as of the last
  // set_base or restore_state, with that round and digest; never what an encode since then
  // changed (a round the node did not finish is done again from here). Tensors
  // "base/<name>" and "residual/<name>" (topk: none for a tensor not encoded yet). Safe to
  // call while a round runs in the background.
  struct SavedState {
    int64_t round = -1;
    std::string model_sha256;
    NamedTensors tensors;
  };
  SavedState saved_state() const;
  // Takes a saved state back (a node continuing its checkpoint). Every tensor is checked
  // against `reg`'s trainable tensors first (known name, same shape, fp32, finite; every base
  // present, and every residual unless topk): the first that does not match throws an Error
  // naming it, and nothing changes.
  void restore_state(const ParamRegistry& reg, const SavedState& s);
  // The node's trainable set changed (a new ownership epoch, at a round boundary, `reg` now
  // the new set): a tensor trainable before and after keeps its base and residual; one it
  // gained gets its base from `published` (the round's published model; the same registry
  // in a blocking round) and a zero residual; one it lost is dropped with its residual (the
  // residual is this node's quantisation error of a tensor it no longer uploads: nobody can
  // use it). Returns the names of the residuals dropped.
  std::vector<std::string> change_trainable_set(const ParamRegistry& reg,
                                                const ParamRegistry& published);
  // This round's upload stream (throws, naming the tensor, when a delta is not finite); updates
  // the residual and remembers q for rebuilt().
  SafetensorsStreamWriter encode(const ParamRegistry& reg, const UploadMeta& meta);
  // The round used the upload: the trainable tensors become base + deq(q).
  void apply_rebuilt(const ParamRegistry& reg) const;
  // With unsent_in_weights, after the node took a round (its trainable tensors = base + what
  // it trained since the upload, the trainable set settled): adds the accumulator to them, the
  // weights it trains on until the next upload. No-op otherwise, and for a tensor not encoded
  // yet.
  void add_unsent(const ParamRegistry& reg) const;
  // Payload bytes of this node's compressed upload.
  uint64_t upload_data_bytes(const ParamRegistry& reg) const;
  // The residual's squared norm (for the node's metrics).
  double residual_sq() const;
  // The base of trainable tensor `name` (fp32 CPU contiguous; undefined when it is not one):
  // what the node holds of the published model it last took, for applying a published delta.
  torch::Tensor base(const std::string& name) const;

 private:
  SafetensorsStreamWriter encode_topk(const ParamRegistry& reg, const UploadMeta& meta);
  Compression c_;
  std::vector<torch::Tensor> base_, residual_;  // per trainable entry, registry order
  std::vector<EncodedDelta> sent_;              // q of the last encode()
  TopkParams published_;
  TopkFeedback topk_;                           // topk: the accumulator (residual_ unused)
  std::vector<std::string> sent_topk_;          // topk: the payloads of the last encode()
  bool unsent_in_weights_ = false;              // topk: the node trains on base + a
  std::unordered_map<std::string, size_t> base_index_;  // name -> index in base_
  // The state as of the last set_base / restore_state (for saved_state()): base_ and the
  // residual (topk: accumulator) tensors then (an encode replaces them, never mutates them).
  mutable std::mutex saved_mu_;
  int64_t saved_round_ = -1;
  std::string saved_sha_;
  std::vector<std::string> saved_names_;
  std::vector<torch::Tensor> saved_base_, saved_residual_;
  void keep_saved(int64_t round, const std::string& model_sha256);
};

}  // namespace spes::sync
