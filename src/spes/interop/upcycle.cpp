// Dense -> MoE upcycling (see upcycle.h).
#include "spes/interop/upcycle.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include <cmath>
#include <unordered_map>

#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/interop/model_build.h"
#include "spes/interop/model_source.h"

namespace spes {

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
                 o.router_init == "zeros",
             "upcycle: --router-init must be normal, scaled_normal or zeros, found '{}'",
             o.router_init);
  SPES_CHECK(o.router_std > 0, "upcycle: --router-std must be positive, found {}", o.router_std);
  ModelConfig m = dense;
  m.block_type = "moe";
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
      if (o.noise_std > 0 && o.noise_fraction > 0) {
        torch::Tensor mask = at::rand(w.sizes(), gen) < o.noise_fraction;
        torch::Tensor noise = at::normal(0.0, o.noise_std, w.sizes(), gen);
        w = w + noise * mask.to(w.scalar_type());
      }
      p.tensor.copy_(w);
    } else if (ends_with(p.name, ".mlp.gate.weight")) {  // the router
      if (o.router_init == "zeros")
        p.tensor.zero_();
      else
        p.tensor.copy_(at::normal(0.0, router_std, p.tensor.sizes(), gen));
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
