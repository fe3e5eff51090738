// Transformer construction (HF OLMoE tensor names), initialisation and forward pass.
#include "spes/model/transformer.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <unordered_map>

#include "spes/common/error.h"
#include "spes/model/activation_checkpoint.h"
#include "spes/model/initial_weights.h"
#include "spes/model/layers.h"
#include "spes/model/model_size_guard.h"

namespace spes {

std::string expert_param_name(int64_t layer, int64_t expert, const std::string& proj) {
  return fmt::format("model.layers.{}.mlp.experts.{}.{}.weight", layer, expert, proj);
}

void Transformer::add_param(const std::string& name, torch::Tensor t, ParamRole role,
                            int64_t layer, int64_t expert) {
  params_.push_back({name, t, role, layer, expert});
}

Transformer::Transformer(const ModelConfig& cfg, torch::Device device, ModelRuntime runtime)
    : cfg_(cfg), device_(device), runtime_(std::move(runtime)) {
  // Before the first tensor is allocated in this machine's memory (a model on the meta device
  // allocates nothing; one on a GPU is not checked here).
  if (device.is_cpu()) check_model_fits_memory(cfg, "model");
  check_runtime();
  // Every weight in model order (the registry's, the checkpoints' and the digest's).
  embed_ = zero_weight({cfg.embedding_rows(), cfg.d_model});
  add_param("model.embed_tokens.weight", embed_);
  blocks_.resize(cfg.n_layers);
  for (int64_t l = 0; l < cfg.n_layers; ++l) {
    add_attention(l);
    add_layer_norms(l);
    if (cfg.is_moe())
      add_moe(l);
    else
      add_dense_mlp(l);
  }
  final_norm_ = one_weight(cfg.d_model);
  add_param("model.norm.weight", final_norm_);
  lm_head_ = zero_weight({cfg.embedding_rows(), cfg.d_model});
  add_param("lm_head.weight", lm_head_);
  std::tie(rope_cos_, rope_sin_) =
      rope_tables(cfg.max_sequence_length, cfg.head_dim(), cfg.rope_theta, device);
}

void Transformer::check_runtime() const {
  const auto& tr = runtime_.trainable_experts;
  SPES_CHECK(tr.empty() || (static_cast<int64_t>(tr.size()) == cfg_.n_layers &&
                            static_cast<int64_t>(tr[0].size()) == cfg_.moe_num_experts),
             "internal: the trainable-expert table is {} x {}, the model has {} x {} experts",
             tr.size(), tr.empty() ? 0 : tr[0].size(), cfg_.n_layers, cfg_.moe_num_experts);
  SPES_CHECK(runtime_.grouped() || runtime_.frozen_dtype == torch::kFloat32,
             "internal: frozen experts in another dtype need the grouped expert layout");
}

torch::Tensor Transformer::zero_weight(at::IntArrayRef shape) const {
  return torch::zeros(shape, torch::TensorOptions().dtype(torch::kFloat32).device(device_));
}

void Transformer::add_zero_weight(torch::Tensor& slot, at::IntArrayRef shape,
                                  const std::string& name) {
  slot = zero_weight(shape);
  add_param(name, slot);
}

torch::Tensor Transformer::one_weight(int64_t n) const {
  return torch::ones({n}, torch::TensorOptions().dtype(torch::kFloat32).device(device_));
}

void Transformer::add_attention(int64_t l) {
  BlockWeights& b = blocks_[l];
  const std::string p = fmt::format("model.layers.{}.", l);
  const int64_t D = cfg_.d_model, kv_dim = cfg_.kv_heads() * cfg_.head_dim();
  add_zero_weight(b.q, {D, D}, p + "self_attn.q_proj.weight");
  add_zero_weight(b.k, {kv_dim, D}, p + "self_attn.k_proj.weight");
  add_zero_weight(b.v, {kv_dim, D}, p + "self_attn.v_proj.weight");
  add_zero_weight(b.o, {D, D}, p + "self_attn.o_proj.weight");
  if (cfg_.qk_norm != QkNorm::None) {
    const bool per_head = cfg_.qk_norm == QkNorm::PerHead;
    b.q_norm = one_weight(per_head ? cfg_.head_dim() : D);
    b.k_norm = one_weight(per_head ? cfg_.head_dim() : kv_dim);
    add_param(p + "self_attn.q_norm.weight", b.q_norm);
    add_param(p + "self_attn.k_norm.weight", b.k_norm);
  }
}

void Transformer::add_layer_norms(int64_t l) {
  BlockWeights& b = blocks_[l];
  const std::string p = fmt::format("model.layers.{}.", l);
  b.attn_norm = one_weight(cfg_.d_model);
  b.mlp_norm = one_weight(cfg_.d_model);
  add_param(p + "input_layernorm.weight", b.attn_norm);
  add_param(p + "post_attention_layernorm.weight", b.mlp_norm);
}

void Transformer::add_moe(int64_t l) {
  BlockWeights& b = blocks_[l];
  const int64_t D = cfg_.d_model, F = cfg_.ffn_hidden_size(), E = cfg_.moe_num_experts;
  b.router = zero_weight({E, D});
  add_param(fmt::format("model.layers.{}.mlp.gate.weight", l), b.router);
  b.experts.resize(E);
  if (runtime_.grouped()) {  // the experts are views of the layer's stacked storage
    const auto& tr = runtime_.trainable_experts;
    std::vector<bool> trainable = tr.empty() ? std::vector<bool>(E, true)
                                             : std::vector<bool>(tr[l].begin(), tr[l].end());
    b.stack = expert_stack_create(b.experts, trainable, D, F, runtime_.grouped_dtype,
                                  runtime_.frozen_dtype, device_);
  }
  for (int64_t e = 0; e < E; ++e) {
    ExpertWeights& x = b.experts[e];
    if (!runtime_.grouped()) {
      x.w1 = zero_weight({F, D});
      x.v1 = zero_weight({F, D});
      x.w2 = zero_weight({D, F});
    }
    add_param(expert_param_name(l, e, "gate_proj"), x.w1, ParamRole::Expert, l, e);
    add_param(expert_param_name(l, e, "up_proj"), x.v1, ParamRole::Expert, l, e);
    add_param(expert_param_name(l, e, "down_proj"), x.w2, ParamRole::Expert, l, e);
  }
}

void Transformer::add_dense_mlp(int64_t l) {
  BlockWeights& b = blocks_[l];
  const std::string p = fmt::format("model.layers.{}.", l);
  const int64_t D = cfg_.d_model, F = cfg_.ffn_hidden_size();
  b.experts.resize(1);
  ExpertWeights& x = b.experts[0];
  add_zero_weight(x.w1, {F, D}, p + "mlp.gate_proj.weight");
  add_zero_weight(x.v1, {F, D}, p + "mlp.up_proj.weight");
  add_zero_weight(x.w2, {D, F}, p + "mlp.down_proj.weight");
}

void Transformer::init_weights(uint64_t seed, const InitialWeights* initial) {
  if (initial) {  // start from given weights (model/initial_weights.h)
    load_initial_weights(*initial);
    spdlog::info("model initialised from {} ({} tensors)", initial->origin, params_.size());
    return;
  }
  SPES_CHECK(cfg_.init_checkpoint.empty(), "model.init_checkpoint is '{}' but this model was "
             "given no initial weights: the program that builds it must read them "
             "(interop/init_checkpoint.h, init_checkpoint_weights) and hand them down",
             cfg_.init_checkpoint);
  torch::NoGradGuard ng;
  // A private CPU generator makes the init independent of the device and of global RNG use.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const double std = cfg_.init_std, cut = cfg_.init_cutoff_factor * cfg_.init_std;
  for (auto& p : params_) {
    if (p.tensor.dim() == 1) {
      p.tensor.fill_(1.0);
      continue;
    }
    // Truncated normal by resampling: draw N(0, std), redraw entries outside +-cut.
    torch::Tensor t = at::normal(0.0, std, p.tensor.sizes(), gen);
    for (int iter = 0; iter < 100; ++iter) {
      torch::Tensor bad = t.abs() > cut;
      if (!bad.any().item<bool>()) break;
      torch::Tensor fresh = at::normal(0.0, std, p.tensor.sizes(), gen);
      t = torch::where(bad, fresh, t);
    }
    p.tensor.copy_(t.clamp(-cut, cut));
  }
}

void Transformer::load_initial_weights(const InitialWeights& w) {
  check_same_architecture(cfg_, w.architecture, w.origin);
  SPES_CHECK(params_.size() == w.tensors.size(), "{}: {} tensors, the model has {}", w.origin,
             w.tensors.size(), params_.size());
  torch::NoGradGuard ng;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& [name, t] = w.tensors[i];
    SPES_CHECK(params_[i].name == name && params_[i].tensor.sizes() == t.sizes(),
               "{}: tensor {} is '{}', the model expects '{}'", w.origin, i, name,
               params_[i].name);
    params_[i].tensor.copy_(t);
  }
}

void Transformer::set_trainable_experts(const std::vector<std::vector<bool>>& trainable) {
  const int64_t L = cfg_.n_layers, E = cfg_.is_moe() ? cfg_.moe_num_experts : 0;
  SPES_CHECK(static_cast<int64_t>(trainable.size()) == L &&
                 (L == 0 || static_cast<int64_t>(trainable[0].size()) == E),
             "internal: the trainable-expert table is {} x {}, the model has {} x {} experts",
             trainable.size(), trainable.empty() ? 0 : trainable[0].size(), L, E);
  if (!runtime_.grouped()) return;  // one fp32 tensor per expert, trained or not
  const int64_t D = cfg_.d_model, F = cfg_.ffn_hidden_size();
  torch::NoGradGuard ng;
  for (int64_t l = 0; l < L; ++l) {
    const std::vector<bool> before = runtime_.trainable_experts.empty()
                                         ? std::vector<bool>(E, true)
                                         : runtime_.trainable_experts[l];
    if (before == trainable[l]) continue;
    BlockWeights& b = blocks_[l];
    std::vector<ExpertWeights> fresh(E);
    ExpertStack stack = expert_stack_create(fresh, trainable[l], D, F, runtime_.grouped_dtype,
                                            runtime_.frozen_dtype, device_);
    for (int64_t e = 0; e < E; ++e) {  // the new slots are refreshed from these at first use
      fresh[e].w1.copy_(b.experts[e].w1);
      fresh[e].v1.copy_(b.experts[e].v1);
      fresh[e].w2.copy_(b.experts[e].w2);
    }
    for (auto& p : params_) {
      if (p.role != ParamRole::Expert || p.layer != l) continue;
      const ExpertWeights& x = fresh[p.expert];
      if (p.name == expert_param_name(l, p.expert, "gate_proj")) p.tensor = x.w1;
      else if (p.name == expert_param_name(l, p.expert, "up_proj")) p.tensor = x.v1;
      else p.tensor = x.w2;
    }
    b.experts = std::move(fresh);
    b.stack = std::move(stack);
  }
  runtime_.trainable_experts = trainable;
}

Transformer Transformer::replica_sharing_weights() const {
  Transformer r(*this);  // copies the tensor handles; each is then replaced by an alias
  std::unordered_map<const c10::TensorImpl*, torch::Tensor> alias;
  auto swap = [&](torch::Tensor& t) {
    if (!t.defined()) return;
    auto it = alias.find(t.unsafeGetTensorImpl());
    if (it == alias.end()) {
      torch::Tensor a = t.detach();
      a.set_requires_grad(t.requires_grad());
      it = alias.emplace(t.unsafeGetTensorImpl(), a).first;
    }
    t = it->second;
  };
  swap(r.embed_);
  swap(r.final_norm_);
  swap(r.lm_head_);
  for (auto& b : r.blocks_) {
    for (torch::Tensor* t : {&b.attn_norm, &b.q, &b.k, &b.v, &b.o, &b.q_norm, &b.k_norm,
                             &b.mlp_norm, &b.router, &b.stack.w13, &b.stack.w2})
      swap(*t);
    for (auto& e : b.experts) {
      swap(e.w1);
      swap(e.v1);
      swap(e.w2);
    }
  }
  for (auto& p : r.params_) {
    SPES_CHECK(alias.count(p.tensor.unsafeGetTensorImpl()),
               "internal: parameter {} is not a member of the model", p.name);
    swap(p.tensor);
  }
  return r;
}

std::unique_ptr<Transformer> transformer_on_device(const Transformer& model,
                                                   const torch::Device& device) {
  auto out = std::make_unique<Transformer>(model.config(), device);
  torch::NoGradGuard ng;
  for (size_t i = 0; i < model.params().size(); ++i) {
    const torch::Tensor& t = out->params()[i].tensor;
    t.copy_(model.params()[i].tensor);
    t.set_requires_grad(false);
  }
  return out;
}

int64_t Transformer::num_params() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.tensor.numel();
  return n;
}

torch::Tensor Transformer::block_forward_plain(const BlockWeights& b, const torch::Tensor& x,
                                               RouterStats* stats) const {
  torch::Tensor h = x + attention_forward(b, rms_norm(x, b.attn_norm, cfg_.layer_norm_eps), cfg_,
                                          rope_cos_, rope_sin_);
  torch::Tensor hn = rms_norm(h, b.mlp_norm, cfg_.layer_norm_eps);
  const auto shape = hn.sizes().vec();
  torch::Tensor flat = hn.reshape({-1, cfg_.d_model});
  torch::Tensor y;
  if (cfg_.is_moe() && b.stack.defined()) {
    y = moe_forward_grouped(flat, b.router, b.experts, b.stack, cfg_.moe_top_k,
                            cfg_.moe_norm_topk_prob, stats);
  } else if (cfg_.is_moe()) {
    y = moe_forward(flat, b.router, b.experts, cfg_.moe_top_k, cfg_.moe_norm_topk_prob, stats);
  } else {
    y = expert_forward(b.experts[0], flat);
  }
  return h + y.view(shape);
}

torch::Tensor Transformer::block_forward(int64_t layer, const torch::Tensor& x,
                                         std::vector<RouterStats>* routers) const {
  const BlockWeights& b = blocks_[layer];
  const bool checkpoint = runtime_.checkpoint_every > 0 &&
                          layer % runtime_.checkpoint_every == 0 && torch::GradMode::is_enabled() &&
                          x.requires_grad();
  if (!checkpoint) {
    RouterStats stats;
    torch::Tensor y = block_forward_plain(b, x, cfg_.is_moe() ? &stats : nullptr);
    if (cfg_.is_moe() && routers) routers->push_back(std::move(stats));
    return y;
  }
  // Keeps x only; the block (router statistics included) is recomputed in backward. The
  // router logits are an output so that the auxiliary losses' gradients reach the router.
  const bool moe = cfg_.is_moe();
  auto outs = checkpoint_apply(
      [this, &b, moe](const torch::Tensor& in) -> std::vector<torch::Tensor> {
        RouterStats st;
        torch::Tensor y = block_forward_plain(b, in, moe ? &st : nullptr);
        if (!moe) return {y};
        return {y, st.logits, st.counts};
      },
      x, moe ? std::vector<int64_t>{2} : std::vector<int64_t>{});
  if (moe && routers) routers->push_back({outs[1], torch::softmax(outs[1], -1), outs[2]});
  return outs[0];
}

ForwardResult Transformer::forward(const torch::Tensor& tokens) const {
  SPES_CHECK(tokens.dim() == 2, "model input must be [batch, seq] token ids, got {} dims",
             tokens.dim());
  SPES_CHECK(tokens.size(1) <= cfg_.max_sequence_length,
             "sequence length {} exceeds model.max_sequence_length {}", tokens.size(1),
             cfg_.max_sequence_length);
  ForwardResult r;
  torch::Tensor x = embed_.index_select(0, tokens.reshape({-1}).to(device_))
                        .view({tokens.size(0), tokens.size(1), cfg_.d_model});
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    r.block_inputs.push_back(x);
    x = block_forward(l, x, &r.routers);
  }
  r.block_inputs.push_back(x);
  r.hidden = rms_norm(x, final_norm_, cfg_.layer_norm_eps);
  return r;
}

torch::Tensor Transformer::logits(const torch::Tensor& tokens) const {
  ForwardResult r = forward(tokens);
  return torch::matmul(r.hidden, lm_head_.t());
}

}  // namespace spes
