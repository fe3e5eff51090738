// `spes upcycle`: turns a dense model (Hugging Face directory or checkpoint) into an MoE
// checkpoint whose experts start as copies of the dense MLP. See docs/INTEROP.md.
#include <iostream>

#include "cli/command.h"
#include "spes/interop/upcycle.h"

namespace {

struct UpcycleArgs {
  std::string from, out;
  spes::UpcycleOptions o;
  int64_t max_seq_len = 0;
  bool weights_only = false, overwrite = false;
};

void run_upcycle(const UpcycleArgs& a) {
  const spes::ModelConfig m = spes::upcycle_to_checkpoint(a.from, a.out, a.o, a.max_seq_len,
                                                          a.weights_only, a.overwrite);
  std::cout << "upcycled " << a.from << " to " << a.out << ": " << m.n_layers << " layers of "
            << m.moe_num_experts << " experts (top-" << m.moe_top_k << ", "
            << (m.moe_norm_topk_prob ? "normalised" : "raw") << " weights), router "
            << a.o.router_init << "\n"
            << "train it: spes train --config " << a.out
            << "/config.yaml --set data.paths=DATA --resume " << a.out
            << "; or start a SPES run with --set model.init_checkpoint=" << a.out << std::endl;
}

spes::cli::SubcommandRegistrar register_upcycle(
    "upcycle", "Turn a dense model into an MoE checkpoint (experts copied from the MLP)",
    [](CLI::App& sub) {
      auto a = std::make_shared<UpcycleArgs>();
      sub.add_option("--from", a->from, "Dense model: Hugging Face directory or checkpoint")
          ->required();
      sub.add_option("--out", a->out, "Checkpoint directory to write")->required();
      sub.add_option("--experts", a->o.experts, "Experts per layer")->required()->default_str("");
      sub.add_option("--top-k", a->o.top_k, "Experts per token")->required()->default_str("");
      sub.add_option("--norm-topk-prob", a->o.norm_topk_prob,
                     "Renormalise the top-k weights to sum 1 (then, without noise, the MoE "
                     "computes exactly the dense model)")
          ->default_str(a->o.norm_topk_prob ? "true" : "false");
      sub.add_option("--noise-std", a->o.noise_std, "Std of the noise added to expert weights");
      sub.add_option("--noise-fraction", a->o.noise_fraction,
                     "Fraction of each expert matrix's entries that get noise");
      sub.add_option("--router-init", a->o.router_init,
                     "Router init: normal (std --router-std), scaled_normal (std 1/sqrt(d_model)) "
                     "or zeros");
      sub.add_option("--router-std", a->o.router_std, "Std of the normal router init");
      sub.add_option("--seed", a->o.seed, "Seed of the noise and router draws");
      sub.add_option("--max-seq-len", a->max_seq_len,
                     "model.max_sequence_length for a Hugging Face source (0: its "
                     "max_position_embeddings)");
      sub.add_flag("--weights-only", a->weights_only, "Omit the fresh optimizer state");
      sub.add_flag("--overwrite", a->overwrite, "Replace OUT if it exists");
      sub.callback([a] { run_upcycle(*a); });
    });

}  // namespace
