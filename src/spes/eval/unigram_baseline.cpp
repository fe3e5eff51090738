// Unigram baseline (see unigram_baseline.h).
#include "spes/eval/unigram_baseline.h"

#include <torch/torch.h>

#include "spes/data/loader.h"

namespace spes {

namespace {
// Counts of the target tokens over every window of a loader (one pass).
torch::Tensor target_counts(BatchLoader& loader, int64_t vocab) {
  torch::Tensor counts = torch::zeros({vocab}, torch::kFloat64);
  const int64_t windows = loader.num_windows(), chunk = 64;
  for (int64_t done = 0; done < windows; done += chunk) {
    Batch b = loader.next(std::min(chunk, windows - done));
    torch::Tensor t = b.targets.reshape({-1});
    t = t.masked_select(t >= 0);
    counts += torch::bincount(t, {}, vocab).to(torch::kFloat64).narrow(0, 0, vocab);
  }
  return counts;
}
}  // namespace

double unigram_baseline_loss(const Config& cfg) {
  const int64_t seq = cfg.model.max_sequence_length, V = cfg.model.vocab_size;
  BatchLoader train(cfg.data, seq, cfg.seed, 0, 1, Split::Train);
  BatchLoader val(cfg.data, seq, cfg.seed, 0, 1, Split::Validation);
  torch::Tensor p = target_counts(train, V) + 1.0;
  p = p / p.sum();
  torch::Tensor v = target_counts(val, V);
  return -(v * p.log()).sum().item<double>() / v.sum().item<double>();
}

}  // namespace spes
