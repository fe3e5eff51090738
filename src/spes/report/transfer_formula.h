// The memory and communication formulas of SPES.md section 4 for one node of a run, computed
// from the parameter counts of the run's config (model/param_counts.h: which tensors are
// shared, which experts the node owns): gradient + AdamW bytes = 12 x trainable values (fp32
// gradient, first and second moment; model/memory_estimate.h has the whole node's memory);
// per round, SPES uploads S + X_i values and downloads P - X_i (P in merge rounds, when its own
// experts changed too); FedAvg and DiLoCo move P each way; centralized training moves nothing.
// With spes_config.compression both directions carry compressed deltas (a node holding the
// previous round downloads the round's delta), counted at the codec's size; topk at the
// payload size its formula expects (sync/wire/topk_kernels.h, topk_expected_bytes: every chunk
// sends its k entries, both ways: the server publishes its change top-k sparse too, averaged
// and merged tensors at topk_down_density, an owner's expert as uploaded).
// The experiment report puts these next to what the runs measured.
#pragma once
#include <cstdint>
#include <string>

#include "spes/io/config.h"
#include "spes/sync/wire/topk_kernels.h"

namespace spes::report {

struct TransferFormula {
  SyncMode mode = SyncMode::Centralized;  // spes_config.mode
  int64_t shared_numel = 0;       // S
  int64_t expert_numel = 0;       // X (all experts of all layers)
  int64_t own_expert_numel = 0;   // X_i (experts node i owns; X in full-model modes)
  int64_t value_bytes = 4;        // transfer dtype: 4 (fp32) or 2 (bf16)
  Compression compression = Compression::None;  // uploads and downloads: bf16 2 bytes per
                                                // value; int8 1 byte + a 4-byte scale per 256
  double topk_density = 1.0 / 64;  // compression topk: spes_config.topk_density, topk_bits
  int topk_bits = 2;
  double topk_down_density = 1.0 / 64;  // ... and the published change of averaged tensors

  int64_t total_numel() const { return shared_numel + expert_numel; }  // P
  int64_t trainable_numel() const;
  int64_t grad_and_optimizer_bytes() const;
  int64_t upload_bytes() const;         // payload only (no safetensors header; int8: the
                                        // scales as if the values were one tensor)
  int64_t download_bytes() const;       // a round without merging (compressed: the delta)
  int64_t download_merge_bytes() const; // a merge round
  // Bytes of `numel` values on the wire (int8: the scales as if the values were one tensor);
  // `averaged`: as the server publishes an averaged (or merged) tensor (topk_down_density).
  int64_t payload_bytes(int64_t numel, bool averaged = false) const;
};

TransferFormula transfer_formula(const Config& cfg, int64_t node);

}  // namespace spes::report
