// `spes upcycle`: turns a dense model (Hugging Face directory or checkpoint) into an MoE
// checkpoint whose experts start as copies of the dense MLP. --recipe copy (the default: exact
// copies, the MoE computes the dense model) or reference (the reference's 9B recipe: noise on
// half of every expert matrix, routers with the std of the dense down_proj); the other options
// override the recipe's values. See docs/INTEROP.md.
#include <fmt/format.h>

#include <iostream>

#include "cli/command.h"
#include "spes/interop/upcycle.h"

namespace {

struct UpcycleArgs {
  std::string from, out, recipe = "copy";
  int64_t experts = 0, top_k = 0;
  spes::UpcycleOptions given;  // values of the options set on the command line
  int64_t max_seq_len = 0;
  bool weights_only = false, overwrite = false;
};

void run_upcycle(const UpcycleArgs& a, const CLI::App& sub) {
  spes::UpcycleOptions o = spes::upcycle_recipe(a.recipe);
  o.experts = a.experts;
  o.top_k = a.top_k;
  auto given = [&](const char* opt) { return sub.get_option(opt)->count() > 0; };
  if (given("--norm-topk-prob")) o.norm_topk_prob = a.given.norm_topk_prob;
  if (given("--noise-std")) o.noise_std = a.given.noise_std;
  if (given("--noise-fraction")) o.noise_fraction = a.given.noise_fraction;
  if (given("--router-init")) o.router_init = a.given.router_init;
  if (given("--router-std")) o.router_std = a.given.router_std;
  if (given("--seed")) o.seed = a.given.seed;
  const spes::ModelConfig m = spes::upcycle_to_checkpoint(a.from, a.out, o, a.max_seq_len,
                                                          a.weights_only, a.overwrite);
  std::cout << "upcycled " << a.from << " to " << a.out << " (recipe " << o.recipe << "): "
            << m.n_layers << " layers of " << m.moe_num_experts << " experts (top-"
            << m.moe_top_k << ", " << (m.moe_norm_topk_prob ? "normalised" : "raw")
            << " weights), noise std " << o.noise_std << " on a fraction " << o.noise_fraction
            << " of each expert matrix, router " << o.router_init << "\n"
            << "train it: spes train --config " << a.out
            << "/config.yaml --set data.paths=DATA --resume " << a.out
            << "; or start a SPES run with --set model.init_checkpoint=" << a.out << std::endl;
}

spes::cli::SubcommandRegistrar register_upcycle(
    "upcycle", "Turn a dense model into an MoE checkpoint (experts copied from the MLP)",
    [](CLI::App& sub) {
      auto a = std::make_shared<UpcycleArgs>();
      const spes::UpcycleOptions copy = spes::upcycle_recipe("copy");
      const spes::UpcycleOptions ref = spes::upcycle_recipe("reference");
      sub.add_option("--from", a->from, "Dense model: Hugging Face directory or checkpoint")
          ->required();
      sub.add_option("--out", a->out, "Checkpoint directory to write")->required();
      sub.add_option("--experts", a->experts, "Experts per layer")->required()->default_str("");
      sub.add_option("--top-k", a->top_k, "Experts per token")->required()->default_str("");
      sub.add_option("--recipe", a->recipe,
                     "copy: exact copies, router normal(0, " + fmt::format("{}", copy.router_std) +
                         ") (with normalised top-k the MoE computes the dense model); "
                         "reference: the reference's 9B recipe, noise std 0.02 on half of the "
                         "entries of every expert matrix, router std of the layer's dense "
                         "down_proj. The options below override the recipe's values")
          ->check(CLI::IsMember({"copy", "reference"}));
      a->given = copy;
      sub.add_option("--norm-topk-prob", a->given.norm_topk_prob,
                     "Renormalise the top-k weights to sum 1 (then, without noise, the MoE "
                     "computes exactly the dense model)")
          ->default_str(copy.norm_topk_prob ? "true" : "false");
      sub.add_option("--noise-std", a->given.noise_std,
                     "Std of the noise added to expert weights (copy 0, reference " +
                         fmt::format("{}", ref.noise_std) + ")");
      sub.add_option("--noise-fraction", a->given.noise_fraction,
                     "Fraction of each expert matrix's entries that get noise (copy 0, "
                     "reference " + fmt::format("{}", ref.noise_fraction) + ")");
      sub.add_option("--router-init", a->given.router_init,
                     "Router init: normal (std --router-std), scaled_normal (std "
                     "1/sqrt(d_model)), zeros, or down_proj_std (std of the layer's dense "
                     "down_proj weight; reference)");
      sub.add_option("--router-std", a->given.router_std, "Std of the normal router init");
      sub.add_option("--seed", a->given.seed, "Seed of the noise and router draws");
      sub.add_option("--max-seq-len", a->max_seq_len,
                     "model.max_sequence_length for a Hugging Face source (0: its "
                     "max_position_embeddings)");
      sub.add_flag("--weights-only", a->weights_only, "Omit the fresh optimizer state");
      sub.add_flag("--overwrite", a->overwrite, "Replace OUT if it exists");
      sub.callback([a, &sub] { run_upcycle(*a, sub); });
    }, spes::cli::GpuUse::Never);

}  // namespace
