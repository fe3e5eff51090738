// The round plan: for every tensor of the model, which nodes upload it and how the server
// combines it (mean over the nodes present, or the owner's copy), built from the same
// ParamRegistry code the nodes run, so server and nodes cannot disagree about who trains what.
// Also the checks an upload must pass (metadata, names, shapes, dtype, finite values) and
// what each node downloads after a round. Leaves out: the arithmetic (aggregate.h, merge.h).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "spes/io/config.h"
#include "spes/io/safetensors.h"
#include "spes/model/ownership.h"
#include "spes/model/transformer.h"
#include "spes/sync/wire/delta_codec.h"
#include "spes/sync/wire/framing.h"
#include "spes/sync/wire/protocol.h"

namespace spes {
class ParamRegistry;
}

namespace spes::sync {

enum class Combine { Mean, OwnerCopy };

struct PlanTensor {
  std::string name;
  std::vector<int64_t> shape;
  ParamRole role = ParamRole::Shared;
  int64_t layer = -1, expert = -1, owner = -1;
  Combine rule = Combine::Mean;
  std::vector<int64_t> uploaders;  // nodes that train and upload it, ascending
};

class RoundPlan {
 public:
  // One ParamRegistry per node over `model` decides what each node trains (mode spes: shared
  // tensors + its own experts; fedavg/diloco: everything; minus cfg.frozen_experts). Leaves
  // every tensor of `model` with requires_grad false (the server never trains).
  RoundPlan(const Config& cfg, const Transformer& model);
  // The same for ownership epoch `epoch`'s map `ownership` (the config's is epoch 0).
  RoundPlan(const Config& cfg, const Transformer& model, const Ownership& ownership,
            int64_t epoch);

  const Ownership& ownership() const { return ownership_; }
  int64_t ownership_epoch() const { return epoch_; }

  const std::vector<PlanTensor>& tensors() const { return tensors_; }
  int64_t index(const std::string& name) const;  // -1 when not a tensor of the model
  int64_t num_nodes() const { return num_nodes_; }
  SyncMode mode() const { return mode_; }
  WireDtype wire() const { return wire_; }
  // spes_config.compression: how uploads carry their tensors (delta_codec.h).
  Compression compression() const { return compression_; }
  // With compression: topk, the codec's settings (topk_density, topk_bits) of an upload.
  const TopkParams& topk() const { return topk_; }
  // ... and of a published delta (topk_down_density: its averaged tensors may be denser).
  const TopkParams& topk_published() const { return topk_published_; }
  // Indices (model order) of the tensors `node` uploads each round.
  const std::vector<size_t>& upload_of(int64_t node) const { return upload_.at(node); }
  // The longest safetensors header a node's upload can need (its tensors' names, shapes and
  // offsets, and its metadata, with slack): a longer header is refused before it is parsed.
  uint64_t max_upload_header_bytes(int64_t node) const;
  // Indices `node` downloads after a round: every tensor the round may have changed, except
  // the node's own owner-copied tensors when merging did not touch them (they already hold
  // the published value).
  std::vector<size_t> download_for(int64_t node, bool merged) const;
  // Exact byte sizes of a node's upload data (fp32 in memory x wire element size, or the
  // compressed deltas with their scales; topk: the most its payloads can take).
  uint64_t upload_data_bytes(int64_t node) const;

 private:
  std::vector<PlanTensor> tensors_;
  std::unordered_map<std::string, size_t> by_name_;
  std::vector<std::vector<size_t>> upload_;
  int64_t num_nodes_ = 0;
  SyncMode mode_;
  WireDtype wire_ = WireDtype::F32;
  Compression compression_ = Compression::None;
  TopkParams topk_, topk_published_;
  Ownership ownership_;
  int64_t epoch_ = 0;
};

// Metadata of an upload stream (strings in the safetensors header).
struct UploadMeta {
  int64_t node = -1, round = -1, step = -1, tokens = 0;
  uint64_t incarnation = 0;
  std::string model_fingerprint;
  Compression compression = Compression::None;  // metadata "compression" (absent: none)
  // metadata "ownership_epoch": the epoch whose map the node trained under (protocol 8; -1
  // when absent: not checked, the tensor list still is).
  int64_t ownership_epoch = -1;
};
Metadata upload_metadata(const UploadMeta& m);
// The stream metadata `key` as a non-negative integer; throws SyncError(InvalidArgument) naming
// `origin` when it is missing or anything else.
int64_t metadata_int(const Metadata& md, const char* key, const std::string& origin);
// Checks an upload's header against the plan: format, metadata, exactly the node's upload
// set in model order, shapes, wire dtype (with compression: each tensor's delta dtype, and
// for int8 its scales right before it, F32, one per block; topk: one U8 entry per tensor, of a
// byte count a valid payload can have). `expect_node` < 0: take the node from the metadata.
UploadMeta check_upload_header(const RoundPlan& plan, const StreamHeader& header,
                               int64_t expect_node, const std::string& origin);
// Checks values received for a tensor (the whole tensor or a run of it): all finite. Shapes
// were checked with the header.
void check_upload_run(const StreamEntry& entry, const torch::Tensor& values,
                      const std::string& origin);
// The token count an upload claims must be possible: at most sync_steps x
// global_train_batch_size x max_sequence_length, and positive with weighting=tokens (the
// count then weighs the node's tensors). Throws SyncError(InvalidArgument) naming the limit.
void check_upload_tokens(const Config& cfg, const UploadMeta& meta, const std::string& origin);

// Digest of the model section of a config (nodes and server must agree on it).
std::string model_config_sha256(const Config& cfg);

// Node side: what a node declares on Join (fingerprints from its own registry and config).
JoinInfo node_join_info(const Config& cfg, const ParamRegistry& registry, const NodeId& id,
                        int64_t step);
// Node side: the node's upload stream: its trainable tensors in registry order, in the wire
// dtype, with `meta` in the header.
SafetensorsStreamWriter node_upload_writer(const ParamRegistry& registry, const UploadMeta& meta,
                                           WireDtype wire);

}  // namespace spes::sync
