// AdamW and the LR schedule (see optimizer.h).
#include "spes/train/optimizer.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/variable.h>
#include <fmt/ranges.h>

#include <cmath>
#include <map>
#include <unordered_map>

#include "spes/common/error.h"
#include "spes/train/step_figures.h"

namespace spes {

double lr_at_step(const Config& cfg, int64_t step) {
  const auto& s = cfg.scheduler;
  const double peak = cfg.optimizer.learning_rate;
  if (s.name == SchedulerName::Constant) return peak;
  const int64_t t_max = s.t_max > 0 ? s.t_max : cfg.total_steps();
  if (step < s.t_warmup) {
    const double frac = static_cast<double>(step) / static_cast<double>(s.t_warmup);
    return peak * (s.warmup_start + (1.0 - s.warmup_start) * frac);
  }
  if (step >= t_max) return peak * s.alpha_f;
  const double span = std::max<int64_t>(1, t_max - s.t_warmup);
  const double progress = static_cast<double>(step - s.t_warmup) / span;
  const double lo = peak * s.alpha_f;
  return lo + (peak - lo) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

AdamW::AdamW(std::vector<RegistryEntry> params, const OptimizerConfig& cfg)
    : params_(std::move(params)), cfg_(cfg) {
  for (const auto& p : params_) moments_.emplace_back(p.tensor, cfg_.moment_dtype);
  tensor_steps_.assign(params_.size(), 0);
  rewarm_from_.assign(params_.size(), -1);
}

void AdamW::use_persistent_grads() {
  if (persistent_) return;
  persistent_ = true;
  zeroed_.assign(params_.size(), {nullptr, 0});
  torch::NoGradGuard ng;
  for (size_t i = 0; i < params_.size(); ++i) {
    torch::Tensor& p = params_[i].tensor;
    if (p.grad().defined()) continue;  // a gradient from before counts (zeroed_ matches none)
    p.mutable_grad() = torch::empty_like(p, torch::MemoryFormat::Contiguous).zero_();
    mark_zeroed(i);
  }
}

void AdamW::mark_zeroed(size_t i) {
  const torch::Tensor& g = params_[i].tensor.grad();
  zeroed_[i] = {g.unsafeGetTensorImpl(), g._version()};
}

bool AdamW::stepped(size_t i) const {
  return presence_.empty() ? has_grad(i) : static_cast<bool>(presence_.at(i));
}

bool AdamW::has_grad(size_t i) const {
  const torch::Tensor& g = params_[i].tensor.grad();
  if (!g.defined()) return false;
  if (!persistent_) return true;
  return zeroed_[i].first != g.unsafeGetTensorImpl() || zeroed_[i].second != g._version();
}

namespace {

bool cpu_fast_path(const torch::Tensor& p, const torch::Tensor& g) {
  return p.device().is_cpu() && p.scalar_type() == torch::kFloat32 &&
         g.scalar_type() == torch::kFloat32 && p.is_contiguous() && g.is_contiguous();
}

double sum_squares(const torch::Tensor& g) {
  if (g.device().is_cpu() && g.scalar_type() == torch::kFloat32 && g.is_contiguous()) {
    const float* d = g.data_ptr<float>();
    const int64_t n = g.numel();
    // Deterministic: fixed-size chunks summed in double (SIMD lanes in a fixed order), then
    // combined in chunk order.
    constexpr int64_t kChunk = 1 << 16;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    std::vector<double> partial(chunks, 0.0);
    at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) {
        double s = 0;
        const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
#pragma omp simd reduction(+ : s)
        for (int64_t i = lo; i < hi; ++i) s += static_cast<double>(d[i]) * d[i];
        partial[c] = s;
      }
    });
    double s = 0;
    for (double x : partial) s += x;
    return s;
  }
  return g.to(torch::kFloat64).pow(2).sum().item<double>();
}

// The stochastic-rounding seed of tensor i's moments at optimizer step `step` (a splitmix64
// mix): fixed by the step, so a resumed run rounds as the uninterrupted one.
uint32_t rounding_seed(int64_t step, size_t i) {
  uint64_t z = static_cast<uint64_t>(step) * 0x9e3779b97f4a7c15ULL + i + 1;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return static_cast<uint32_t>(z ^ (z >> 31));
}

// [norm, extra...] as one fp64 vector on the norm's device.
torch::Tensor with_extra(const torch::Tensor& norm, const torch::Tensor& extra) {
  if (!extra.defined()) return norm;
  return torch::cat({norm, extra.detach().reshape({-1}).to(norm.device(), torch::kFloat64)});
}

// A device step's gradient clipping, computed where the gradients are (no host sync): the
// global norm, the factor gradients are multiplied by, torch's found_inf flag ([1]), its 0-d
// boolean (true: the step is skipped) and the fused kernel's grad_scale (it divides by it).
struct DeviceClip {
  torch::Tensor norm, clip, found_inf, skip, grad_scale;
};

DeviceClip device_clip(const std::vector<torch::Tensor>& grads, double max_grad_norm,
                       torch::Device dev) {
  DeviceClip c;
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(dev);
  c.norm = grads.empty()
               ? torch::zeros({}, f32)
               : at::linalg_vector_norm(torch::stack(at::_foreach_norm(grads, 2)), 2)
                     .to(torch::kFloat32);
  c.clip = max_grad_norm > 0
               ? torch::where(c.norm > max_grad_norm, max_grad_norm / (c.norm + 1e-6),
                              torch::ones({}, f32))
               : torch::ones({}, f32);
  c.found_inf = c.norm.isfinite().logical_not().to(torch::kFloat32).view({1});
  // 0-d: true when the step is skipped. (Not found_inf.view({}): `{}` there picks the
  // view-as-dtype overload and reinterprets the float's 4 bytes as uint8.)
  c.skip = c.found_inf.squeeze(0) > 0;
  c.grad_scale = (1.0 / c.clip).view({1});
  return c;
}

// torch's fused kernel's lists for one learning rate: parameters, gradients, both moments and
// the fp32 step counts.
struct FusedLists {
  std::vector<torch::Tensor> p, g, m, v, s;
};

}  // namespace

double AdamW::lr_scale_at(size_t i, int64_t step) const {
  const int64_t from = rewarm_from_[i];
  if (from < 0 || rewarmup_steps_ <= 0) return 1.0;
  const int64_t k = step - from;  // the k-th step since the re-warm-up began
  return k >= rewarmup_steps_ ? 1.0 : static_cast<double>(k) / rewarmup_steps_;
}

double AdamW::lr_scale(size_t i) const { return lr_scale_at(i, step_ + 1); }

int64_t AdamW::index_of(const std::string& name) const {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].name == name) return static_cast<int64_t>(i);
  return -1;
}

ExpertMoments::Entry AdamW::moments_of(size_t i) const {
  auto [m, v] = moments_.at(i).fp32_values();
  return {m, v, tensor_steps_.at(i), rewarm_from_.at(i)};
}

void AdamW::change_params(std::vector<RegistryEntry> params, const ExpertMoments* handed) {
  std::unordered_map<std::string, size_t> old_index;
  for (size_t i = 0; i < params_.size(); ++i) old_index.emplace(params_[i].name, i);
  std::vector<AdamWMoments> moments;
  std::vector<int64_t> steps, rewarm;
  std::vector<bool> kept_old(params_.size(), false);
  torch::NoGradGuard ng;
  for (size_t j = 0; j < params.size(); ++j) {
    const RegistryEntry& p = params[j];
    auto it = old_index.find(p.name);
    if (it != old_index.end()) {  // kept: its state as it is
      kept_old[it->second] = true;
      moments.push_back(std::move(moments_[it->second]));
      steps.push_back(tensor_steps_[it->second]);
      rewarm.push_back(rewarm_from_[it->second]);
      continue;
    }
    moments.emplace_back(p.tensor, cfg_.moment_dtype);
    const ExpertMoments::Entry* given = nullptr;
    if (handed) {
      auto h = handed->by_name.find(p.name);
      if (h != handed->by_name.end()) given = &h->second;
    }
    if (given) {  // handed over: exactly its moments
      const std::unordered_map<std::string, const torch::Tensor*> by_name = {
          {"exp_avg/" + p.name, &given->exp_avg}, {"exp_avg_sq/" + p.name, &given->exp_avg_sq}};
      moments.back().load_state(by_name, p.name, rounding_seed(step_, j));
      steps.push_back(given->step);
      rewarm.push_back(given->rewarm_from);  // a re-warm-up under way goes on
    } else {  // zero moments, bias correction from step 1, learning rate re-warmed
      steps.push_back(0);
      rewarm.push_back(rewarmup_steps_ > 0 ? step_ : -1);
    }
  }
  // Tensors no longer trained: their gradient buffers go (the moments went with moments_).
  for (size_t i = 0; i < params_.size(); ++i)
    if (!kept_old[i]) params_[i].tensor.mutable_grad().reset();
  params_ = std::move(params);
  moments_ = std::move(moments);
  tensor_steps_ = std::move(steps);
  rewarm_from_ = std::move(rewarm);
  presence_.clear();
  device_steps_.clear();  // rebuilt from tensor_steps_ at the next step
  if (!persistent_) return;
  zeroed_.assign(params_.size(), {nullptr, 0});
  for (size_t i = 0; i < params_.size(); ++i) {
    torch::Tensor& g = params_[i].tensor.mutable_grad();
    if (g.defined() && g.is_contiguous()) {
      g.zero_();
    } else {
      g = torch::empty_like(params_[i].tensor, torch::MemoryFormat::Contiguous).zero_();
    }
    mark_zeroed(i);
  }
}

double AdamW::grad_norm() const {
  double s = 0;
  for (size_t i = 0; i < params_.size(); ++i)
    if (stepped(i)) s += sum_squares(params_[i].tensor.grad());
  return std::sqrt(s);
}

double AdamW::step(double lr, double max_grad_norm) {
  const int64_t at = step_ + 1;
  const double norm = StepFigures(step_queued(lr, max_grad_norm)).values()[0].item<double>();
  check_norm(norm, at);
  return norm;
}

void AdamW::check_norm(double norm, int64_t step) {
  SPES_CHECK(std::isfinite(norm), "gradient norm is {} at optimizer step {}: the loss diverged "
             "(lower optimizer.learning_rate or check the data); the update was skipped", norm,
             step);
}

torch::Tensor AdamW::step_queued(double lr, double max_grad_norm, const torch::Tensor& extra) {
  if (!params_.empty() && !params_[0].tensor.device().is_cpu())
    return step_device(lr, max_grad_norm, extra);
  torch::NoGradGuard ng;
  const double norm = grad_norm();
  check_norm(norm, step_ + 1);
  const double clip = (max_grad_norm > 0 && norm > max_grad_norm) ? max_grad_norm / (norm + 1e-6)
                                                                  : 1.0;
  ++step_;
  const double b1 = cfg_.betas[0], b2 = cfg_.betas[1], eps = cfg_.eps, wd = cfg_.weight_decay;
  for (size_t i = 0; i < params_.size(); ++i) {
    torch::Tensor p = params_[i].tensor;
    if (!stepped(i)) continue;
    torch::Tensor g = p.grad();
    const double t = static_cast<double>(++tensor_steps_[i]);
    const double bc1 = 1.0 - std::pow(b1, t), bc2 = 1.0 - std::pow(b2, t);
    const double lr_i = lr * lr_scale_at(i, step_);  // re-warmed after a change of experts
    const double step_size = lr_i / bc1, bc2_sqrt = std::sqrt(bc2);
    if (moments_[i].dtype() != MomentDtype::Fp32) {
      moments_[i].update(p, g, torch::scalar_tensor(clip, torch::kFloat32),
                         {lr_i, wd, b1, b2, eps, bc1, bc2, rounding_seed(step_, i)}, {});
      continue;
    }
    torch::Tensor& m = moments_[i].exp_avg();
    torch::Tensor& v = moments_[i].exp_avg_sq();
    if (cpu_fast_path(p, g)) {
      float* pd = p.data_ptr<float>();
      const float* gd = g.data_ptr<float>();
      float* md = m.data_ptr<float>();
      float* vd = v.data_ptr<float>();
      const float fb1 = b1, fb2 = b2, fclip = clip, decay = 1.0f - float(lr_i * wd);
      const float fstep = step_size, fbc2s = bc2_sqrt, feps = eps;
      at::parallel_for(0, p.numel(), 1 << 14, [&](int64_t b, int64_t e) {
        // One vectorised pass (omp simd + -fno-math-errno): 4x the scalar loop on AVX2.
#pragma omp simd
        for (int64_t j = b; j < e; ++j) {
          const float gj = gd[j] * fclip;
          const float mj = fb1 * md[j] + (1.0f - fb1) * gj;
          const float vj = fb2 * vd[j] + (1.0f - fb2) * gj * gj;
          md[j] = mj;
          vd[j] = vj;
          pd[j] = pd[j] * decay - fstep * mj / (std::sqrt(vj) / fbc2s + feps);
        }
      });
      // Written through raw pointers: say so, as in-place ops do, so that copies made from p
      // (the bf16 expert stacks, model/expert_stack.h) see the new values.
      torch::autograd::impl::bump_version(p);
    } else {
      torch::Tensor gc = clip != 1.0 ? g * clip : g;
      p.mul_(1.0 - lr_i * wd);
      m.mul_(b1).add_(gc, 1.0 - b1);
      v.mul_(b2).addcmul_(gc, gc, 1.0 - b2);
      torch::Tensor denom = (v.sqrt() / bc2_sqrt).add_(eps);
      p.addcdiv_(m, denom, -step_size);
    }
  }
  presence_.clear();
  return with_extra(torch::full({1}, norm, torch::kFloat64), extra);
}

torch::Tensor AdamW::step_device(double lr, double max_grad_norm, const torch::Tensor& extra) {
  torch::NoGradGuard ng;
  const torch::Device dev = params_[0].tensor.device();
  ensure_device_steps(dev);
  std::vector<size_t> idx;
  std::vector<torch::Tensor> grads;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!stepped(i)) continue;
    idx.push_back(i);
    grads.push_back(params_[i].tensor.grad());
  }
  presence_.clear();
  const DeviceClip c = device_clip(grads, max_grad_norm, dev);
  ++step_;
  // torch's fused kernel: same dtype and strides; one call per learning rate (tensors in a
  // re-warm-up after a change of experts have their own). Low-precision moments and anything
  // the kernel cannot take are updated tensor by tensor.
  std::map<double, FusedLists> fused;
  for (size_t j = 0; j < idx.size(); ++j) {
    const size_t i = idx[j];
    ++tensor_steps_[i];
    const double lr_i = lr * lr_scale_at(i, step_);
    const torch::Tensor& g = grads[j];
    if (moments_[i].dtype() != MomentDtype::Fp32) {
      update_low_precision(i, g, lr_i, c.clip, c.skip);
    } else if (fusable(i, g)) {
      FusedLists& f = fused[lr_i];
      f.p.push_back(params_[i].tensor);
      f.g.push_back(g);
      f.m.push_back(moments_[i].exp_avg());
      f.v.push_back(moments_[i].exp_avg_sq());
      f.s.push_back(device_steps_[i]);
    } else {
      update_unfused(i, g, lr_i, c.clip, c.skip);
    }
  }
  for (auto& [lr_f, f] : fused) {
    at::_foreach_add_(f.s, 1);
    at::_fused_adamw_(f.p, f.g, f.m, f.v, {}, f.s, lr_f, cfg_.betas[0], cfg_.betas[1],
                      cfg_.weight_decay, cfg_.eps, /*amsgrad=*/false, /*maximize=*/false,
                      c.grad_scale, c.found_inf);
  }
  return with_extra(c.norm.view({1}).to(torch::kFloat64), extra);
}

void AdamW::ensure_device_steps(torch::Device dev) {
  if (device_steps_.size() == params_.size()) return;  // else: first step, or moments loaded since
  device_steps_.clear();
  for (size_t i = 0; i < params_.size(); ++i)
    device_steps_.push_back(torch::full({}, static_cast<float>(tensor_steps_[i]),
                                        torch::TensorOptions().device(dev)));
}

bool AdamW::fusable(size_t i, const torch::Tensor& g) const {
  const torch::Tensor& p = params_[i].tensor;
  return p.is_non_overlapping_and_dense() && g.strides() == p.strides() &&
         moments_[i].exp_avg().strides() == p.strides() && g.scalar_type() == p.scalar_type();
}

void AdamW::update_low_precision(size_t i, const torch::Tensor& g, double lr_i,
                                 const torch::Tensor& clip, const torch::Tensor& skip) {
  // ATen operations over chunks (train/adamw_moments.h).
  const double t = static_cast<double>(tensor_steps_[i]);
  moments_[i].update(params_[i].tensor, g, clip,
                     {lr_i, cfg_.weight_decay, cfg_.betas[0], cfg_.betas[1], cfg_.eps,
                      1.0 - std::pow(cfg_.betas[0], t), 1.0 - std::pow(cfg_.betas[1], t),
                      rounding_seed(step_, i)},
                     skip);
  device_steps_[i].add_(1);
}

void AdamW::update_unfused(size_t i, const torch::Tensor& g, double lr_i,
                           const torch::Tensor& clip, const torch::Tensor& skip) {
  // A gradient assigned from outside: the fused kernel's update in tensor ops, skipped on a
  // non-finite norm as the kernel does.
  const torch::Tensor& p = params_[i].tensor;
  torch::Tensor& exp_avg = moments_[i].exp_avg();
  torch::Tensor& exp_avg_sq = moments_[i].exp_avg_sq();
  const double t = static_cast<double>(tensor_steps_[i]);
  const double b1 = cfg_.betas[0], b2 = cfg_.betas[1];
  torch::Tensor gc = g * clip;
  torch::Tensor m = exp_avg * b1 + gc * (1.0 - b1);
  torch::Tensor v = exp_avg_sq * b2 + gc * gc * (1.0 - b2);
  torch::Tensor denom = (v.sqrt() / std::sqrt(1.0 - std::pow(b2, t))).add_(cfg_.eps);
  torch::Tensor np = p * (1.0 - lr_i * cfg_.weight_decay) -
                     m / denom * (lr_i / (1.0 - std::pow(b1, t)));
  exp_avg.copy_(torch::where(skip, exp_avg, m));
  exp_avg_sq.copy_(torch::where(skip, exp_avg_sq, v));
  device_steps_[i].add_(1);
  params_[i].tensor.copy_(torch::where(skip, p, np));
}

void AdamW::zero_grad() {
  presence_.clear();
  if (!persistent_) {
    for (auto& p : params_) p.tensor.mutable_grad().reset();
    return;
  }
  torch::NoGradGuard ng;
  for (size_t i = 0; i < params_.size(); ++i) {
    torch::Tensor& g = params_[i].tensor.mutable_grad();
    if (!has_grad(i)) continue;  // still zero
    if (g.is_contiguous()) {
      g.zero_();
    } else {  // a gradient assigned from outside: back to a contiguous buffer
      g = torch::empty_like(params_[i].tensor, torch::MemoryFormat::Contiguous).zero_();
    }
    mark_zeroed(i);
  }
}

NamedTensors AdamW::state_tensors() const {
  NamedTensors out;
  for (size_t i = 0; i < params_.size(); ++i) {
    moments_[i].append_state(params_[i].name, &out);
    out.emplace_back("step/" + params_[i].name, torch::tensor(tensor_steps_[i], torch::kInt64));
    if (lr_scale(i) < 1.0)  // a re-warm-up still running: a resumed run continues it
      out.emplace_back("rewarm_from/" + params_[i].name,
                       torch::tensor(rewarm_from_[i], torch::kInt64));
  }
  return out;
}

void AdamW::check_state(const NamedTensors& tensors, const std::string& origin) const {
  std::unordered_map<std::string, const torch::Tensor*> by_name;
  for (const auto& [n, t] : tensors) by_name[n] = &t;
  for (size_t i = 0; i < params_.size(); ++i) {
    moments_[i].check_state(by_name, params_[i].name, origin);
    auto it = by_name.find("step/" + params_[i].name);
    SPES_CHECK(it != by_name.end(), "{}: optimizer state lacks 'step/{}' (was the checkpoint "
               "made with a different set of trainable tensors?)", origin, params_[i].name);
    const torch::Tensor& st = *it->second;
    SPES_CHECK(st.numel() == 1 && st.scalar_type() == torch::kInt64 && st.item<int64_t>() >= 0,
               "{}: 'step/{}' must be one non-negative int64", origin, params_[i].name);
    auto rw = by_name.find("rewarm_from/" + params_[i].name);
    SPES_CHECK(rw == by_name.end() ||
                   (rw->second->numel() == 1 && rw->second->scalar_type() == torch::kInt64 &&
                    rw->second->item<int64_t>() >= 0),
               "{}: 'rewarm_from/{}' must be one non-negative int64", origin, params_[i].name);
  }
}

void AdamW::load_state(const NamedTensors& tensors, int64_t step_count,
                       const std::string& origin) {
  check_state(tensors, origin);
  std::unordered_map<std::string, const torch::Tensor*> by_name;
  for (const auto& [n, t] : tensors) by_name[n] = &t;
  torch::NoGradGuard ng;
  for (size_t i = 0; i < params_.size(); ++i) {
    moments_[i].load_state(by_name, params_[i].name, rounding_seed(step_count, i));
    tensor_steps_[i] = by_name.at("step/" + params_[i].name)->item<int64_t>();
    auto rw = by_name.find("rewarm_from/" + params_[i].name);
    rewarm_from_[i] = rw == by_name.end() ? -1 : rw->second->item<int64_t>();
  }
  device_steps_.clear();  // rebuilt from tensor_steps_ at the next step
  step_ = step_count;
}

int64_t AdamW::state_bytes() const {
  int64_t n = 0;
  for (const auto& m : moments_) n += m.bytes();
  return n;
}

}  // namespace spes
