// Autoregressive sampling (see generate.h).
#include "spes/eval/generate.h"

#include "spes/common/error.h"

namespace spes {

std::vector<int64_t> generate_tokens(const Transformer& model, std::vector<int64_t> ids,
                                     const SampleOptions& opts) {
  torch::NoGradGuard ng;
  SPES_CHECK(!ids.empty(), "generate: the prompt must hold at least one token");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(opts.seed);
  const int64_t window = model.config().max_sequence_length;
  for (int64_t i = 0; i < opts.max_new_tokens; ++i) {
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(ids.size()) - window);
    torch::Tensor in = torch::tensor(std::vector<int64_t>(ids.begin() + start, ids.end()),
                                     torch::kInt64).unsqueeze(0);
    // Only real tokens: rows past vocab_size pad the table (model.embedding_size).
    torch::Tensor logits = model.logits(in).select(1, in.size(1) - 1).squeeze(0)
                               .narrow(0, 0, model.config().vocab_size)
                               .to(torch::kCPU, torch::kFloat32);
    int64_t next;
    if (opts.temperature <= 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      torch::Tensor l = logits / opts.temperature;
      if (opts.top_k > 0 && opts.top_k < l.size(0)) {
        auto kth = std::get<0>(l.topk(opts.top_k)).min();
        l = l.masked_fill(l < kth, -std::numeric_limits<float>::infinity());
      }
      torch::Tensor p = torch::softmax(l, -1);
      next = at::multinomial(p, 1, false, gen).item<int64_t>();
    }
    ids.push_back(next);
    if (next == opts.stop_token) break;
  }
  return ids;
}

}  // namespace spes
