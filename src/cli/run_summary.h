// The end-of-run summary printed by `spes train`: validation loss and perplexity next to the
// unigram baseline of the same data, and a short generated sample.
#pragma once
#include "spes/train/trainer.h"

namespace spes::cli {

void print_run_summary(Trainer& trainer, const EvalResult& final_eval);

}  // namespace spes::cli
