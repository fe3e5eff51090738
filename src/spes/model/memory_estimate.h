// The memory one node needs to train, by part (SPES.md section 4: frozen experts are used in
// the forward pass but have no gradient and no optimizer state):
//   weights      in the layout the trainer uses (model/runtime_layout.h): fp32
//                master copies of every trainable tensor and, in fp32 runs, of every frozen
//                one; with precision amp_bf16 also 2 bytes per value of every weight: the
//                stacked bf16 experts (frozen experts live only there when they are stored in
//                bf16) and the bf16 copies autocast makes of the shared weights for one step;
//   gradients    fp32, trainable tensors only (4 bytes per trainable value);
//   AdamW        two moments, trainable tensors only, in optimizer.moment_dtype (8 bytes per
//                trainable value in fp32, 4 in bf16, 2 + a scale per block of 256 in int8:
//                moment_bytes() below, the sizes of train/adamw_moments.h's formats);
//   activations  what one micro-batch's forward pass keeps for backward
//                (activation_bytes(), an estimate; its comment lists what it counts);
//   sync state   a SPES/FedAvg/DiLoCo node's sync client: with spes_config.compression the
//                upload base and error-feedback residual (fp32, 8 bytes per trainable value,
//                host), with spes_config.overlap the round in flight's copy of every weight in
//                its storage dtype (host) and of the trainable tensors as uploaded (4 bytes per
//                trainable value, where they live); stream buffers are left out.
// Left out: allocator caching and fragmentation, the CUDA context, temporary buffers of
// single kernels, the data loader, the RoPE tables, and several micro-batches in flight at once
// (CPU threads). This is the one place these figures are computed (`spes config`, `spes
// compare`); tests/model/memory_measured_test.cpp checks the resident parts against the
// tensors of a real step. A closed-form estimate from the config and the parameter counts
// (model/param_counts.h, closed-form too): nothing is built or allocated, so it lives below
// train/ and sync/ for every layer that must size a node before it builds one.
#pragma once
#include <cstdint>
#include <map>
#include <string>

#include "spes/io/config.h"
#include "spes/model/param_counts.h"

namespace spes {

// Values per block of int8 AdamW moments, each block with one fp32 absmax (the format is
// train/adamw_moments.h's; its sizes are here so that the estimate needs nothing above the
// model).
constexpr int64_t kMomentBlock = 256;
// Bytes of both AdamW moments of `numel` values stored as `dtype`.
int64_t moment_bytes(int64_t numel, MomentDtype dtype);

// Bytes of gradients (fp32) and of AdamW moments per node, trainable values only (int8 blocks
// counted over the node's values at once: a few bytes less than tensor by tensor).
inline int64_t gradient_bytes(int64_t trainable_values) { return 4 * trainable_values; }
inline int64_t adam_moment_bytes(int64_t trainable_values,
                                 MomentDtype dtype = MomentDtype::Fp32) {
  return moment_bytes(trainable_values, dtype);
}

// The shape one micro-batch's activations depend on.
struct ActivationShape {
  int64_t micro_batch = 1;  // sequences per forward/backward (device_train_microbatch_size)
  int64_t seq = 1;          // tokens per sequence (max_sequence_length)
  int64_t d_model = 1;      // D
  int64_t layers = 1;       // L
  int64_t heads = 1;        // H (query heads)
  int64_t kv_heads = 1;     // Hkv (key/value heads; Dkv = Hkv x D / H)
  int64_t experts = 0;      // E (0: dense MLP blocks)
  int64_t top_k = 1;        // k (experts per token)
  int64_t ffn_hidden = 1;   // F (each expert's hidden size)
  int64_t vocab = 1;        // V (rows of the LM head: embedding_rows())
  int64_t value_bytes = 4;  // bytes per activation value: 4 (fp32) or 2 (bf16 autocast)
  int64_t checkpoint_every = 0;  // activation checkpointing: blocks l % every == 0 (0: none)
  int64_t logits_chunk_rows = 0;  // LM head in chunks of this many rows (0: all N at once)
};
ActivationShape activation_shape(const Config& cfg);

// Estimated bytes one micro-batch's forward pass keeps for backward, for N = micro_batch x seq
// tokens. Per token and layer, in values of `value_bytes`:
//   attention  5 D + 3 Dkv + H + 1: the RMSNorm input and its 1/rms, the normed input the
//              q/k/v projections read, q and k before QK-norm (D + Dkv), q, k, v after QK-norm
//              and RoPE (D + 2 Dkv), the attention output (read by o_proj) and its per-head
//              log-sum-exp (fused attention keeps no T x T score matrix);
//   MoE        2 D + 1 + 2 E + k (2 D + 3 F): the RMSNorm input, 1/rms and normed input, the
//              router's logits and probabilities, and per routed slot the expert's input row,
//              its gate and up outputs, their SwiGLU product (read by down_proj) and its output
//              (weighted into the sum); a dense block counts the MLP as one slot, no router;
// plus per token 2 D + 1 for the final RMSNorm, and the LM head's N x V logits in fp32 twice
// (the logits and the softmax / gradient the loss builds from them); with the chunked head
// (model/chunked_lm_loss.cpp, every path but fp32 on CPU) only one chunk of rows of those.
// A checkpointed block keeps only its input (D values per token); in backward one of them at a
// time is recomputed in full, so one block's activations are added back once.
// Not counted: integer routing indices, the residual stream's own copies, kernel workspaces.
int64_t activation_bytes(const ActivationShape& s);

struct NodeMemory {
  std::map<std::string, int64_t> weights_by_dtype;  // "fp32", "bf16" -> bytes
  int64_t autocast_copies = 0;  // the part of "bf16" that exists only during a step
  int64_t gradients = 0;
  int64_t adam_moments = 0;
  int64_t activations = 0;
  int64_t sync_state = 0;
  int64_t weights() const;
  int64_t total() const;
};

// Memory of the node `counts` were made for (param_counts(cfg, node)).
NodeMemory node_memory(const Config& cfg, const ParamCounts& counts);
// Memory of a node that trains `experts_per_layer` experts of every MoE layer of the run `cfg`
// at `precision` (its other settings the run's): what a server compares with the capacity a
// node declares before it hands it experts (issue 38). total() is the figure; "auto" counts as
// fp32, as in node_memory.
NodeMemory node_memory_training(const Config& cfg, int64_t experts_per_layer,
                                Precision precision);
// The most experts per layer a node of the run `cfg` can train at `precision` within `bytes`:
// the largest k in [0, moe_num_experts] whose node_memory_training(cfg, k, precision).total()
// is at most `bytes` (it grows with k); -1 when not even k = 0 (the shared weights) fits. 0
// for a dense model that fits.
int64_t experts_within_memory(const Config& cfg, double bytes, Precision precision);

}  // namespace spes
