// The end-of-run result printed by `spes train` and `spes launch`: validation loss and
// perplexity next to the unigram baseline of the same data, and a short generated sample.
#pragma once
#include <string>

#include "spes/train/trainer.h"

namespace spes::cli {

struct RunResult {
  int64_t steps = 0, tokens = 0;  // tokens: seen by the whole run (all nodes)
  bool has_validation = false;
  EvalResult validation;
};

void print_run_result(const Config& cfg, Transformer& model, const RunResult& r);

// `spes train`: the trainer's model and its final evaluation.
void print_run_summary(Trainer& trainer, const EvalResult& final_eval);

// `spes launch`: the final model as node 0 saved it (every node holds the same model after the
// last sync) and the nodes' final validation loss (summary.json).
void print_cluster_summary(const std::string& launch_dir);

}  // namespace spes::cli
