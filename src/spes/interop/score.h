// Per-token log-probabilities of a token sequence under a model: the number to compare this
// implementation with another one (transformers, a reference run) on identical token ids.
#pragma once
#include <cstdint>
#include <vector>

#include "spes/model/transformer.h"

namespace spes {

// logprobs[i] = log p(tokens[i+1] | tokens[0..i]) from one forward pass (fp32 logits, log-softmax
// in fp64); tokens.size() - 1 values. Throws for ids outside the vocabulary or a sequence longer
// than model.max_sequence_length.
std::vector<double> score_tokens(const Transformer& model, const std::vector<int64_t>& tokens);

}  // namespace spes
