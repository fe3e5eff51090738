// Batches for training and validation from token shards: the corpus is cut into non-overlapping
// windows of seq_len tokens (tail dropped); a held-out part is kept for validation; training
// windows are visited in a seeded permutation per epoch, optionally split across nodes; the
// position is a small state that a checkpoint stores for exact resume.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "spes/io/config.h"

namespace spes {

class TokenCorpus;  // token_corpus.h: memory-mapped shards

struct Batch {
  torch::Tensor tokens;   // [B, T] int64
  torch::Tensor targets;  // [B, T] int64: tokens shifted left by one; -1 = no target (last slot)
};

struct LoaderState {
  int64_t epoch = 0;
  int64_t position = 0;  // index into this epoch's (node's) window order
};

enum class Split { Train, Validation };

class BatchLoader {
 public:
  // node_id/num_nodes choose this node's seed (seed + 1000 * node_id) or, with
  // data.split_across_nodes, a disjoint strided slice of one shared permutation.
  BatchLoader(const DataConfig& data, int64_t seq_len, int64_t seed, int64_t node_id,
              int64_t num_nodes, Split split);
  ~BatchLoader();
  BatchLoader(BatchLoader&&) noexcept;

  // Next batch of `batch_size` windows. Train: wraps into a new epoch (new permutation).
  // Validation: windows in fixed order, wrapping to the start.
  Batch next(int64_t batch_size);
  LoaderState state() const;
  void restore(const LoaderState& s);
  void reset();  // back to the first window (validation passes)
  int64_t num_windows() const;       // windows this loader visits per epoch
  int64_t total_tokens() const;      // tokens in the underlying corpus
  int64_t vocab_size_hint() const;   // from the shard manifest, or -1 when unknown

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spes
