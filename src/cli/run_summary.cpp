// End-of-run result (see run_summary.h).
#include "cli/run_summary.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>

#include "spes/common/error.h"
#include "spes/data/tokenizer.h"
#include "spes/data/tokenizer_path.h"
#include "spes/eval/generate.h"
#include "spes/eval/unigram_baseline.h"
#include "spes/io/files.h"
#include "spes/io/run_layout.h"
#include "spes/train/loaded_model.h"

namespace spes::cli {

void print_run_result(const Config& cfg, Transformer& model, const RunResult& r) {
  std::printf("\n=== result after %lld steps, %lld tokens ===\n", static_cast<long long>(r.steps),
              static_cast<long long>(r.tokens));
  if (r.has_validation) {
    const double base = unigram_baseline_loss(cfg);
    std::printf("validation loss   %.4f nats/token (perplexity %.1f) on %lld tokens\n",
                r.validation.loss, r.validation.perplexity,
                static_cast<long long>(r.validation.tokens));
    std::printf("unigram baseline  %.4f nats/token (perplexity %.1f)\n", base, std::exp(base));
    std::printf("improvement       %.4f nats/token below the baseline\n",
                base - r.validation.loss);
  }
  const std::string tok_path = resolve_tokenizer_path(cfg.data);
  if (tok_path.empty()) return;
  auto tok = tokenizer_load(tok_path);
  const std::string prompt = "And it came to pass";
  SampleOptions o;
  o.max_new_tokens = 48;
  o.stop_token = tok->eos_id();
  auto ids = generate_tokens(model, tok->encode(prompt), o);
  std::printf("sample: %s\n", tok->decode(ids).c_str());
  std::fflush(stdout);
}

void print_run_summary(Trainer& trainer, const EvalResult& final_eval) {
  RunResult r;
  r.steps = trainer.state().step;
  r.tokens = trainer.state().tokens;
  r.has_validation = trainer.has_validation();
  r.validation = final_eval;
  print_run_result(trainer.config(), trainer.model(), r);
}

void print_cluster_summary(const std::string& dir) {
  const auto summary = nlohmann::json::parse(file_read(run_layout::cluster_summary(dir)));
  // The nodes that ran to the end (not one stopped by a scripted disruption): the first one's
  // checkpoint is the final model, their validation losses are the run's.
  std::vector<nlohmann::json> finished;
  int64_t node_steps = 0;
  for (const auto& node : summary.at("nodes")) {
    node_steps += node.value("steps", int64_t{0});
    if (!node.contains("disrupted")) finished.push_back(node);
  }
  SPES_CHECK(!finished.empty(), "{}: no node ran to the end", dir);
  const std::string node0 = run_layout::cluster_node(dir, finished[0].at("node").get<int64_t>());
  LoadedModel lm = load_model_from_checkpoint(run_layout::checkpoint(node0));
  RunResult r;
  double loss = 0;
  int64_t n = 0;
  for (const auto& node : finished) {
    r.steps = std::max(r.steps, node.value("steps", int64_t{0}));
    if (node.contains("final_val_loss")) {
      loss += node["final_val_loss"].get<double>();
      ++n;
    }
  }
  r.tokens = node_steps * lm.config.tokens_per_step();  // every node's steps, a stopped one's too
  r.has_validation = n > 0;
  if (n > 0) {
    r.validation.loss = loss / static_cast<double>(n);
    r.validation.perplexity = std::exp(r.validation.loss);
    for (const auto& line : read_jsonl(run_layout::metrics(node0)))
      if (line.contains("val_tokens")) r.validation.tokens = line["val_tokens"].get<int64_t>();
  }
  print_run_result(lm.config, *lm.model, r);
}

}  // namespace spes::cli
