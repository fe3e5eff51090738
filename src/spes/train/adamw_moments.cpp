// AdamW moments in fp32, bf16 or 8-bit block-wise form (see adamw_moments.h).
#include "spes/train/adamw_moments.h"

#include <fmt/ranges.h>
#include <torch/csrc/autograd/variable.h>

#include <cmath>

#include "spes/common/error.h"

namespace spes {
namespace {

constexpr int64_t kMask32 = 0xffffffffLL;
// Levels of the int8 codes: 8 per octave; the largest level (code 127 / 255) is the absmax.
constexpr double kLevelsPerOctave = 8.0;
constexpr int64_t kSignedTop = 127, kUnsignedTop = 255;

int64_t blocks_of(int64_t n) { return (n + kMomentBlock - 1) / kMomentBlock; }

torch::Tensor f32(const torch::Tensor& t) { return t.to(torch::kFloat32); }

// `x` (1-D) padded with zeros to a multiple of kMomentBlock.
torch::Tensor pad_to_blocks(const torch::Tensor& x) {
  const int64_t n = x.numel(), padded = blocks_of(n) * kMomentBlock;
  if (padded == n) return x;
  return torch::cat({x, torch::zeros({padded - n}, x.options())});
}

}  // namespace

torch::Tensor moment_rounding_bits(int64_t lo, int64_t n, uint32_t seed,
                                   const torch::Device& device) {
  // A 32-bit integer hash (xor-shift-multiply, two rounds; multipliers below 2^31 so that no
  // product leaves int64) of index ^ seed.
  auto o = torch::TensorOptions().dtype(torch::kInt64).device(device);
  torch::Tensor x = torch::arange(lo, lo + n, o).bitwise_and_(kMask32);
  x.bitwise_xor_(static_cast<int64_t>(seed));
  for (int round = 0; round < 2; ++round) {
    x = x.bitwise_xor(x.bitwise_right_shift(16)).mul_(0x45d9f3b).bitwise_and_(kMask32);
  }
  return x.bitwise_xor_(x.bitwise_right_shift(16));
}

std::pair<torch::Tensor, torch::Tensor> quantize_moment(const torch::Tensor& x,
                                                        const torch::Tensor& bits,
                                                        bool is_signed) {
  SPES_CHECK(x.dim() == 1 && x.numel() % kMomentBlock == 0,
             "internal: quantize_moment wants whole blocks of {} values", kMomentBlock);
  const int64_t top = is_signed ? kSignedTop : kUnsignedTop;
  const torch::Tensor blocks = x.view({-1, kMomentBlock});
  const torch::Tensor mag = blocks.abs();
  const torch::Tensor absmax = std::get<0>(mag.max(1));  // [blocks]
  // Magnitude relative to the block's absmax, in [0, 1] (0 for an all-zero block).
  const torch::Tensor r = mag / absmax.clamp_min(1e-38f).unsqueeze(1);
  // The level below r (code t, value 2^((t - top) / 8), code 0 = value 0) and the one above.
  const torch::Tensor t =
      torch::floor(torch::log2(r) * kLevelsPerOctave + static_cast<double>(top))
          .clamp_(0, static_cast<double>(top - 1));
  const torch::Tensor lo_val =
      torch::where(t == 0, torch::zeros_like(r),
                   torch::exp2((t - static_cast<double>(top)) / kLevelsPerOctave));
  const torch::Tensor hi_val = torch::exp2((t + 1.0 - static_cast<double>(top)) / kLevelsPerOctave);
  // Up with probability (r - lo) / (hi - lo): the expected value is r.
  const torch::Tensor p = ((r - lo_val) / (hi_val - lo_val)).clamp_(0, 1);
  const torch::Tensor u = (bits.view({-1, kMomentBlock}).to(torch::kFloat32) + 0.5f) / 65536.0f;
  torch::Tensor code = t + (u < p).to(torch::kFloat32);
  if (is_signed) {
    code = code * torch::sign(blocks);
    return {code.to(torch::kInt8).view({-1}), absmax};
  }
  return {code.to(torch::kUInt8).view({-1}), absmax};
}

torch::Tensor dequantize_moment(const torch::Tensor& codes, const torch::Tensor& absmax) {
  const bool is_signed = codes.scalar_type() == torch::kInt8;
  const double top = static_cast<double>(is_signed ? kSignedTop : kUnsignedTop);
  const torch::Tensor c = codes.view({-1, kMomentBlock}).to(torch::kFloat32);
  const torch::Tensor k = c.abs();
  torch::Tensor v =
      torch::where(k == 0, torch::zeros_like(k), torch::exp2((k - top) / kLevelsPerOctave));
  if (is_signed) v = v * torch::sign(c);
  return (v * absmax.unsqueeze(1)).view({-1});
}

torch::Tensor round_bf16_stochastic(const torch::Tensor& x, const torch::Tensor& bits) {
  // The fp32 bit pattern plus 16 random bits in its low half, then truncated to the bf16 that
  // the high half is: rounds the magnitude up with probability (dropped bits) / 2^16.
  torch::Tensor i = x.contiguous().view(torch::kInt32).to(torch::kInt64);
  i = i.add_(bits).bitwise_and_(~int64_t{0xffff});
  return i.to(torch::kInt32).view(torch::kFloat32).to(torch::kBFloat16);
}

AdamWMoments::AdamWMoments(const torch::Tensor& param, MomentDtype dtype)
    : dtype_(dtype), numel_(param.numel()), sizes_(param.sizes().vec()) {
  auto o = torch::TensorOptions().device(param.device());
  switch (dtype) {
    case MomentDtype::Fp32:  // full precision: the parameter's own dtype (fp32, or fp64 in tests)
      m_ = torch::zeros_like(param, torch::MemoryFormat::Contiguous);
      v_ = torch::zeros_like(m_);
      break;
    case MomentDtype::Bf16:
      m_ = torch::zeros(param.sizes(), o.dtype(torch::kBFloat16));
      v_ = torch::zeros_like(m_);
      break;
    case MomentDtype::Int8:
      m_ = torch::zeros({numel_}, o.dtype(torch::kInt8));
      v_ = torch::zeros({numel_}, o.dtype(torch::kUInt8));
      m_absmax_ = torch::zeros({blocks_of(numel_)}, o.dtype(torch::kFloat32));
      v_absmax_ = torch::zeros_like(m_absmax_);
      break;
  }
}

int64_t AdamWMoments::bytes() const {
  int64_t n = m_.nbytes() + v_.nbytes();
  if (m_absmax_.defined()) n += m_absmax_.nbytes() + v_absmax_.nbytes();
  return n;
}

std::pair<torch::Tensor, torch::Tensor> AdamWMoments::fp32_values() const {
  torch::NoGradGuard ng;
  auto [m, v] = load(0, numel_);
  auto host = [&](const torch::Tensor& t) {
    return t.reshape(sizes_).to(torch::kCPU, torch::kFloat32, /*non_blocking=*/false,
                                /*copy=*/true);
  };
  return {host(m), host(v)};
}

std::pair<torch::Tensor, torch::Tensor> AdamWMoments::load(int64_t lo, int64_t n) const {
  if (dtype_ != MomentDtype::Int8)
    return {f32(m_.view({-1}).narrow(0, lo, n)), f32(v_.view({-1}).narrow(0, lo, n))};
  // Whole blocks (lo is block-aligned), then the n values asked for.
  const int64_t b0 = lo / kMomentBlock, nb = blocks_of(n);
  auto codes = [&](const torch::Tensor& c) { return pad_to_blocks(c.narrow(0, lo, n)); };
  torch::Tensor m = dequantize_moment(codes(m_), m_absmax_.narrow(0, b0, nb)).narrow(0, 0, n);
  torch::Tensor v = dequantize_moment(codes(v_), v_absmax_.narrow(0, b0, nb)).narrow(0, 0, n);
  // A second moment of 0 means no gradient so far (see adamw_moments.h).
  return {torch::where(v == 0, torch::zeros_like(m), m), v};
}

void AdamWMoments::store(int64_t lo, const torch::Tensor& m, const torch::Tensor& v,
                         uint32_t seed, const torch::Tensor& skip) {
  const int64_t n = m.numel();
  const torch::Tensor bits = moment_rounding_bits(lo, n, seed, m.device());
  const torch::Tensor bits_m = bits.bitwise_and(0xffff), bits_v = bits.bitwise_right_shift(16);
  // Keeps `old` where the step is skipped.
  auto keep = [&](const torch::Tensor& old, const torch::Tensor& now) {
    return skip.defined() ? torch::where(skip, old, now) : now;
  };
  if (dtype_ == MomentDtype::Bf16) {
    torch::Tensor mdst = m_.view({-1}).narrow(0, lo, n), vdst = v_.view({-1}).narrow(0, lo, n);
    mdst.copy_(keep(mdst, round_bf16_stochastic(m, bits_m)));
    vdst.copy_(keep(vdst, round_bf16_stochastic(v, bits_v)));
    return;
  }
  const int64_t b0 = lo / kMomentBlock, nb = blocks_of(n);
  auto put = [&](torch::Tensor& codes, torch::Tensor& absmax, const torch::Tensor& x,
                 const torch::Tensor& b, bool is_signed) {
    auto [c, a] = quantize_moment(pad_to_blocks(x), pad_to_blocks(b), is_signed);
    torch::Tensor cdst = codes.narrow(0, lo, n), adst = absmax.narrow(0, b0, nb);
    cdst.copy_(keep(cdst, c.narrow(0, 0, n)));
    adst.copy_(keep(adst, a));
  };
  put(m_, m_absmax_, m, bits_m, true);
  put(v_, v_absmax_, v, bits_v, false);
}

void AdamWMoments::update(const torch::Tensor& param, const torch::Tensor& grad,
                          const torch::Tensor& grad_scale, const Hyper& h,
                          const torch::Tensor& skip) {
  SPES_CHECK(dtype_ != MomentDtype::Fp32, "internal: fp32 moments are updated by the optimizer");
  SPES_CHECK(param.is_contiguous() && param.scalar_type() == torch::kFloat32,
             "internal: low-precision moments need a contiguous fp32 parameter");
  torch::NoGradGuard ng;
  const torch::Tensor p = param.view({-1}), g = grad.reshape({-1});
  const torch::Tensor scale = f32(grad_scale);
  const double step_size = h.lr / h.bias1, bc2_sqrt = std::sqrt(h.bias2);
  for (int64_t lo = 0; lo < numel_; lo += kMomentChunk) {
    const int64_t n = std::min(kMomentChunk, numel_ - lo);
    const torch::Tensor gc = f32(g.narrow(0, lo, n)) * scale;
    auto [m, v] = load(lo, n);
    m.mul_(h.beta1).add_(gc, 1.0 - h.beta1);
    v.mul_(h.beta2).addcmul_(gc, gc, 1.0 - h.beta2);
    torch::Tensor pc = p.narrow(0, lo, n);
    const torch::Tensor denom = (v.sqrt() / bc2_sqrt).add_(h.eps);
    torch::Tensor now = pc * (1.0 - h.lr * h.weight_decay) - m / denom * step_size;
    pc.copy_(skip.defined() ? torch::where(skip, pc, now) : now);
    store(lo, m, v, h.seed, skip);
  }
  torch::autograd::impl::bump_version(param);  // copies made from it (expert stacks) refresh
}

void AdamWMoments::append_state(const std::string& name, NamedTensors* out) const {
  out->emplace_back("exp_avg/" + name, m_);
  out->emplace_back("exp_avg_sq/" + name, v_);
  if (dtype_ == MomentDtype::Int8) {
    out->emplace_back("exp_avg_absmax/" + name, m_absmax_);
    out->emplace_back("exp_avg_sq_absmax/" + name, v_absmax_);
  }
}

void AdamWMoments::check_state(
    const std::unordered_map<std::string, const torch::Tensor*>& by_name,
    const std::string& name, const std::string& origin) const {
  auto need = [&](const std::string& key) -> const torch::Tensor& {
    auto it = by_name.find(key);
    SPES_CHECK(it != by_name.end(), "{}: optimizer state lacks '{}' (was the checkpoint made "
               "with a different set of trainable tensors?)", origin, key);
    return *it->second;
  };
  const torch::Tensor& m = need("exp_avg/" + name);
  const torch::Tensor& v = need("exp_avg_sq/" + name);
  if (m.scalar_type() == torch::kInt8 || v.scalar_type() == torch::kUInt8) {  // int8 codes
    SPES_CHECK(m.scalar_type() == torch::kInt8 && v.scalar_type() == torch::kUInt8,
               "{}: optimizer tensors 'exp_avg/{}' and 'exp_avg_sq/{}' must be int8 and uint8 "
               "codes (moment_dtype int8), found {} and {}", origin, name, name,
               c10::toString(m.scalar_type()), c10::toString(v.scalar_type()));
    for (const torch::Tensor* c : {&m, &v})
      SPES_CHECK(c->numel() == numel_, "{}: int8 optimizer codes of '{}' have {} values but "
                 "the parameter has {}", origin, name, c->numel(), numel_);
    SPES_CHECK(!(m == -128).any().item<bool>(), "{}: 'exp_avg/{}' holds the int8 value -128, "
               "which is no moment code (-127 .. 127)", origin, name);
    for (const char* key : {"exp_avg_absmax/", "exp_avg_sq_absmax/"}) {
      const torch::Tensor& a = need(key + name);
      SPES_CHECK(a.scalar_type() == torch::kFloat32 && a.dim() == 1 &&
                     a.size(0) == blocks_of(numel_),
                 "{}: '{}{}' must be fp32 [{}] (one scale per {} values)", origin, key, name,
                 blocks_of(numel_), kMomentBlock);
      SPES_CHECK(torch::isfinite(a).all().item<bool>() && (a >= 0).all().item<bool>(),
                 "{}: '{}{}' holds negative or non-finite scales", origin, key, name);
    }
    return;
  }
  for (const auto* t : {&m, &v}) {
    const std::string key = (t == &m ? "exp_avg/" : "exp_avg_sq/") + name;
    SPES_CHECK(t->sizes() == torch::IntArrayRef(sizes_), "{}: optimizer tensor '{}' has shape "
               "[{}] but the parameter has [{}]", origin, key, fmt::join(t->sizes(), ", "),
               fmt::join(sizes_, ", "));
    SPES_CHECK(t->is_floating_point() && torch::isfinite(*t).all().item<bool>(),
               "{}: optimizer tensor '{}' is not finite floating point data", origin, key);
  }
  SPES_CHECK((v >= 0).all().item<bool>(), "{}: optimizer tensor 'exp_avg_sq/{}' has negative "
             "values (a second moment is a mean of squares)", origin, name);
}

void AdamWMoments::set_dense(const torch::Tensor& m, const torch::Tensor& v, uint32_t seed) {
  torch::NoGradGuard ng;
  switch (dtype_) {
    case MomentDtype::Fp32:
    case MomentDtype::Bf16:
      // bf16 from fp32: to nearest (a one-off conversion, no drift to correct).
      m_.view({-1}).copy_(m.reshape({-1}));
      v_.view({-1}).copy_(v.reshape({-1}));
      return;
    case MomentDtype::Int8:
      for (int64_t lo = 0; lo < numel_; lo += kMomentChunk) {
        const int64_t n = std::min(kMomentChunk, numel_ - lo);
        store(lo, f32(m.reshape({-1}).narrow(0, lo, n).to(m_.device())),
              f32(v.reshape({-1}).narrow(0, lo, n).to(m_.device())), seed, {});
      }
      return;
  }
}

void AdamWMoments::load_state(
    const std::unordered_map<std::string, const torch::Tensor*>& by_name,
    const std::string& name, uint32_t seed) {
  torch::NoGradGuard ng;
  const torch::Tensor& m = *by_name.at("exp_avg/" + name);
  const torch::Tensor& v = *by_name.at("exp_avg_sq/" + name);
  if (m.scalar_type() != torch::kInt8) {
    set_dense(m, v, seed);
    return;
  }
  const torch::Tensor& ma = *by_name.at("exp_avg_absmax/" + name);
  const torch::Tensor& va = *by_name.at("exp_avg_sq_absmax/" + name);
  if (dtype_ == MomentDtype::Int8) {  // the same codes: a resumed run goes on bit for bit
    m_.copy_(m.reshape({-1}));
    v_.copy_(v.reshape({-1}));
    m_absmax_.copy_(ma);
    v_absmax_.copy_(va);
    return;
  }
  auto dense = [&](const torch::Tensor& codes, const torch::Tensor& absmax) {
    return dequantize_moment(pad_to_blocks(codes.reshape({-1})), absmax).narrow(0, 0, numel_);
  };
  const torch::Tensor md = dense(m, ma), vd = dense(v, va);
  set_dense(torch::where(vd == 0, torch::zeros_like(md), md), vd, seed);
}

}  // namespace spes
