// Per-token log-probabilities (see score.h).
#include "spes/interop/score.h"

#include "spes/common/error.h"

namespace spes {

std::vector<double> score_tokens(const Transformer& model, const std::vector<int64_t>& tokens) {
  const ModelConfig& c = model.config();
  SPES_CHECK(!tokens.empty(), "score: no tokens to score (the text encodes to nothing)");
  SPES_CHECK(static_cast<int64_t>(tokens.size()) <= c.max_sequence_length,
             "score: {} tokens exceed model.max_sequence_length {}", tokens.size(),
             c.max_sequence_length);
  for (int64_t id : tokens)
    SPES_CHECK(id >= 0 && id < c.vocab_size, "score: token id {} is outside the vocabulary "
               "[0, {})", id, c.vocab_size);
  if (tokens.size() == 1) return {};
  torch::NoGradGuard ng;
  const auto T = static_cast<int64_t>(tokens.size());
  torch::Tensor ids = torch::tensor(tokens, torch::kInt64).view({1, T});
  torch::Tensor logp = torch::log_softmax(model.logits(ids)[0].to(torch::kFloat64), -1);
  torch::Tensor next = ids[0].narrow(0, 1, T - 1).unsqueeze(1).to(logp.device());
  torch::Tensor lp = logp.narrow(0, 0, T - 1).gather(1, next).squeeze(1).cpu().contiguous();
  return std::vector<double>(lp.data_ptr<double>(), lp.data_ptr<double>() + (T - 1));
}

}  // namespace spes
