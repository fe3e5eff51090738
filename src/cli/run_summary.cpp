// End-of-run summary (see run_summary.h).
#include "cli/run_summary.h"

#include <cmath>
#include <cstdio>

#include "spes/data/tokenizer.h"
#include "spes/data/tokenizer_path.h"
#include "spes/eval/generate.h"
#include "spes/eval/unigram_baseline.h"

namespace spes::cli {

void print_run_summary(Trainer& trainer, const EvalResult& r) {
  const Config& cfg = trainer.config();
  std::printf("\n=== result after %lld steps, %lld tokens ===\n",
              static_cast<long long>(trainer.state().step),
              static_cast<long long>(trainer.state().tokens));
  if (trainer.has_validation()) {
    const double base = unigram_baseline_loss(cfg);
    std::printf("validation loss   %.4f nats/token (perplexity %.1f) on %lld tokens\n", r.loss,
                r.perplexity, static_cast<long long>(r.tokens));
    std::printf("unigram baseline  %.4f nats/token (perplexity %.1f)\n", base, std::exp(base));
    std::printf("improvement       %.4f nats/token below the baseline\n", base - r.loss);
  }
  const std::string tok_path = resolve_tokenizer_path(cfg.data);
  if (tok_path.empty()) return;
  auto tok = tokenizer_load(tok_path);
  const std::string prompt = "And it came to pass";
  SampleOptions o;
  o.max_new_tokens = 48;
  o.stop_token = tok->eos_id();
  auto ids = generate_tokens(trainer.model(), tok->encode(prompt), o);
  std::printf("sample: %s\n", tok->decode(ids).c_str());
  std::fflush(stdout);
}

}  // namespace spes::cli
