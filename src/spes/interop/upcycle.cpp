// Dense -> MoE upcycling (see upcycle.h).
#include "spes/interop/upcycle.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <unordered_map>

#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/interop/model_build.h"
#include "spes/interop/model_source.h"

namespace spes {

UpcycleOptions upcycle_recipe(const std::string& name) {
  UpcycleOptions o;
  o.recipe = name;
  if (name == "copy") return o;
  SPES_CHECK(name == "reference", "upcycle: --recipe must be copy (exact copies of the dense "
             "MLP) or reference (the reference's noise and router), found '{}'", name);
  o.noise_std = 0.02;
  o.noise_fraction = 0.5;
  o.router_init = "down_proj_std";
  o.norm_topk_prob = true;
  return o;
}

namespace {

// Adds N(0, std) to exactly floor(fraction x numel) entries of `w`, chosen uniformly at random
// without repeats (the reference's randperm selection).
torch::Tensor add_noise_to_fraction(torch::Tensor w, double fraction, double std,
                                    at::Generator& gen) {
  const int64_t n = w.numel();
  const int64_t k = static_cast<int64_t>(static_cast<double>(n) * fraction);
  if (k == 0 || std == 0) return w;
  torch::Tensor flat = w.contiguous().view({-1}).clone();
  const torch::Tensor idx = at::randperm(n, gen, torch::kInt64).narrow(0, 0, k);
  const torch::Tensor noise = at::normal(0.0, std, at::IntArrayRef(k), gen);
  flat.index_add_(0, idx, noise.to(flat.scalar_type()));
  return flat.view(w.sizes());
}

}  // namespace

ModelConfig upcycle_config(const ModelConfig& dense, const UpcycleOptions& o) {
  SPES_CHECK(!dense.is_moe(), "upcycle: the source is already an MoE model (model.block_type "
             "moe, {} experts); upcycling needs a dense model", dense.moe_num_experts);
  SPES_CHECK(o.experts >= 1, "upcycle: --experts must be at least 1, found {}", o.experts);
  SPES_CHECK(o.top_k >= 1 && o.top_k <= o.experts,
             "upcycle: --top-k must be in [1, experts={}], found {}", o.experts, o.top_k);
  SPES_CHECK(o.noise_std >= 0 && std::isfinite(o.noise_std),
             "upcycle: --noise-std must be a finite number >= 0, found {}", o.noise_std);
  SPES_CHECK(o.noise_fraction >= 0 && o.noise_fraction <= 1,
             "upcycle: --noise-fraction must be in [0, 1], found {}", o.noise_fraction);
  SPES_CHECK(o.router_init == "normal" || o.router_init == "scaled_normal" ||
                 o.router_init == "zeros" || o.router_init == "down_proj_std",
             "upcycle: --router-init must be normal, scaled_normal, zeros or down_proj_std, "
             "found '{}'", o.router_init);
  SPES_CHECK(o.router_std > 0, "upcycle: --router-std must be positive, found {}", o.router_std);
  ModelConfig m = dense;
  m.block_type = BlockType::Moe;
  m.moe_num_experts = o.experts;
  m.moe_top_k = o.top_k;
  m.moe_norm_topk_prob = o.norm_topk_prob;
  m.init_checkpoint.clear();
  return m;
}

std::unique_ptr<Transformer> upcycle_model(const Transformer& dense, const UpcycleOptions& o) {
  const ModelConfig& dc = dense.config();
  const ModelConfig mc = upcycle_config(dc, o);
  auto moe = std::make_unique<Transformer>(mc, torch::kCPU);
  std::unordered_map<std::string, torch::Tensor> src;
  for (const auto& p : dense.params()) src[p.name] = p.tensor.detach();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  const double router_std =
      o.router_init == "scaled_normal" ? 1.0 / std::sqrt(static_cast<double>(mc.d_model))
                                       : o.router_std;
  torch::NoGradGuard ng;
  // Parameters come in registry order (per layer: attention, norms, router, experts), so the
  // random draws are a fixed function of the seed.
  for (const auto& p : moe->params()) {
    auto copy_from = [&](const std::string& name) -> torch::Tensor {
      auto it = src.find(name);
      SPES_CHECK(it != src.end(), "upcycle: the dense model has no tensor '{}'", name);
      return it->second.clone();
    };
    if (p.role == ParamRole::Expert) {
      std::string proj;
      for (const char* c : {"gate_proj", "up_proj", "down_proj"})
        if (p.name == expert_param_name(p.layer, p.expert, c)) proj = c;
      SPES_CHECK(!proj.empty(), "upcycle: unexpected expert tensor '{}'", p.name);
      torch::Tensor w = copy_from(fmt::format("model.layers.{}.mlp.{}.weight", p.layer, proj));
      p.tensor.copy_(add_noise_to_fraction(w, o.noise_fraction, o.noise_std, gen));
    } else if (ends_with(p.name, ".mlp.gate.weight")) {  // the router
      double std = router_std;
      if (o.router_init == "down_proj_std") {  // the reference's fallback for a zero std: 0.02
        const std::string mlp = p.name.substr(0, p.name.size() - std::strlen("gate.weight"));
        std = copy_from(mlp + "down_proj.weight").std().item<double>();
        if (!(std > 0)) std = 0.02;
      }
      if (o.router_init == "zeros")
        p.tensor.zero_();
      else
        p.tensor.copy_(at::normal(0.0, std, p.tensor.sizes(), gen));
    } else {
      p.tensor.copy_(copy_from(p.name));
    }
  }
  for (const auto& p : moe->params()) p.tensor.set_requires_grad(false);
  return moe;
}

ModelConfig upcycle_to_checkpoint(const std::string& from, const std::string& out_dir,
                                  const UpcycleOptions& o, int64_t max_seq_len, bool weights_only,
                                  bool overwrite) {
  check_output_dir(out_dir, overwrite);
  SourceModel src = source_model_load(from, max_seq_len);
  upcycle_config(src.config.model, o);  // validate before the work
  auto moe = upcycle_model(*src.model, o);
  src.model.reset();
  Config cfg = src.config;
  cfg.model = moe->config();
  checkpoint_write_fresh(out_dir, cfg, *moe, src.tokenizer_file, weights_only);
  return cfg.model;
}

}  // namespace spes
