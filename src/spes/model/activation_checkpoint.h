// Activation checkpointing: runs a function of one tensor without keeping its intermediate
// activations, and recomputes them during backward (with the same autocast settings) to
// propagate the gradient. Only the input is kept. Parameters the function reads receive their
// gradients during that recomputation (accumulated into .grad as in any backward pass), so
// they need not be inputs. Leaves out: random number state (the model has no dropout).
#pragma once
#include <torch/torch.h>

#include <functional>
#include <vector>

namespace spes {

using CheckpointedFn = std::function<std::vector<torch::Tensor>(const torch::Tensor&)>;

// Outputs of fn(x). `non_differentiable` lists output indices that carry no gradient (e.g.
// counts). The function must be deterministic and must outlive the backward pass. Without
// grad mode, or when x does not require grad, simply returns fn(x).
std::vector<torch::Tensor> checkpoint_apply(const CheckpointedFn& fn, const torch::Tensor& x,
                                            const std::vector<int64_t>& non_differentiable = {});

}  // namespace spes
