// The training objective of SPES.md section 2, each term kept separately for logging:
// next-token cross-entropy, load-balancing loss, router z-loss and output z-loss.
#pragma once
#include <torch/torch.h>

#include <vector>

#include "spes/io/config.h"
#include "spes/model/transformer.h"

namespace spes {

struct LossTerms {
  torch::Tensor total;      // what backward() is called on
  torch::Tensor ce;         // mean next-token cross-entropy over positions with a target
  torch::Tensor lb;         // weighted load-balancing loss (0 for dense models)
  torch::Tensor router_z;   // weighted router z-loss
  torch::Tensor z;          // weighted output z-loss
  torch::Tensor n_targets;  // int64 scalar: positions that contributed to ce (on the device)
  std::vector<torch::Tensor> block_inputs;  // ForwardResult::block_inputs of this pass
};

// Cross-entropy and output z-loss from LM logits [N, V] and targets [N] (-1 = ignored).
// Computes logsumexp once for both terms.
std::pair<torch::Tensor, torch::Tensor> lm_losses(const torch::Tensor& logits,
                                                  const torch::Tensor& targets);
// The same two terms from the final hidden states h [N, D] and the LM head [V, D]: on CPU one
// fused autograd node (logits computed, reduced and turned into their gradient in place);
// elsewhere lm_losses(h W^T).
std::pair<torch::Tensor, torch::Tensor> lm_head_losses(const torch::Tensor& h,
                                                       const torch::Tensor& lm_head,
                                                       const torch::Tensor& targets);
// The same two terms for any device and dtype, in chunks of rows (chunked_lm_loss.cpp): no
// [N, V] tensor beyond one chunk (chunk_rows; 0: about 256 MB of fp32 logits). `total` is
// ce + z_weight * z and carries the gradient (computed during the forward pass, so logits are
// computed once); `ce` and the unweighted `z` are for logging. Products run in
// autocast_compute_dtype(h) with fp32 results, against the head padded with zero rows to a
// multiple of `vocab_multiple` entries (0: lm_head_vocab_multiple; same values and gradients).
struct LmHeadLoss {
  torch::Tensor total, ce, z;
};
// Rows per chunk when chunk_rows is 0: about 256 MB of fp32 logits for a vocabulary of `vocab`
// (model/memory_estimate counts the same).
int64_t lm_head_default_chunk_rows(int64_t vocab);
// The padding the products use by default: 64 on CUDA when the head is converted for them
// anyway (amp_bf16: aligned leading dimensions for cuBLAS at no extra memory), else 1 (none).
int64_t lm_head_vocab_multiple(const torch::Tensor& h, const torch::Tensor& lm_head);
LmHeadLoss lm_head_losses_chunked(const torch::Tensor& h, const torch::Tensor& lm_head,
                                  const torch::Tensor& targets, double z_weight,
                                  int64_t chunk_rows = 0, int64_t vocab_multiple = 0);
// Unweighted load-balancing loss: E/(L*T*k) * sum_l sum_e c_{l,e} * mean_t p_{l,t,e}.
torch::Tensor load_balancing_loss(const std::vector<RouterStats>& routers, int64_t top_k);
// Unweighted router z-loss: sum_l mean_t logsumexp(router_logits)^2.
torch::Tensor router_z_loss(const std::vector<RouterStats>& routers);

// Runs the model on a batch and combines every term with the config's weights.
LossTerms compute_losses(const Transformer& model, const torch::Tensor& tokens,
                         const torch::Tensor& targets);

}  // namespace spes
