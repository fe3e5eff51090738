// RMSNorm (fp32) and rotate-half rotary position embeddings.
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>

#include <cmath>

#include "spes/model/layers.h"

namespace spes {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// Rows per task of the row-parallel kernels; the weight gradient is summed per fixed block of
// rows and the blocks in order, so results do not depend on the number of threads.
constexpr int64_t kRowBlock = 64;

// y = x * r * w with r = 1/sqrt(mean(x^2) + eps) per row; one pass to read, one to write.
// Saves x and r; backward: dx = r * (dy*w) - x * r^3/n * sum(dy*w*x), dw = sum_rows dy*x*r.
struct RMSNormFn : public torch::autograd::Function<RMSNormFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x_,
                               const torch::Tensor& w_, double eps) {
    torch::Tensor x = x_.contiguous(), w = w_.contiguous();
    const int64_t n = x.size(-1), rows = x.numel() / n;
    torch::Tensor y = torch::empty_like(x);
    torch::Tensor r = torch::empty({rows}, x.options());
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm_fwd", [&] {
      const scalar_t* xp = x.data_ptr<scalar_t>();
      const scalar_t* wp = w.data_ptr<scalar_t>();
      scalar_t* yp = y.data_ptr<scalar_t>();
      scalar_t* rp = r.data_ptr<scalar_t>();
      at::parallel_for(0, rows, kRowBlock, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          const scalar_t* xi = xp + i * n;
          double ss = 0;
          for (int64_t j = 0; j < n; ++j) ss += double(xi[j]) * xi[j];
          const scalar_t ri = scalar_t(1.0 / std::sqrt(ss / n + eps));
          rp[i] = ri;
          scalar_t* yi = yp + i * n;
          for (int64_t j = 0; j < n; ++j) yi[j] = xi[j] * ri * wp[j];
        }
      });
    });
    ctx->save_for_backward({x, w, r});
    return y;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    torch::Tensor x = saved[0], w = saved[1], r = saved[2];
    torch::Tensor dy = grads[0].contiguous();
    const int64_t n = x.size(-1), rows = x.numel() / n;
    const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
    const bool need_dx = ctx->needs_input_grad(0), need_dw = ctx->needs_input_grad(1);
    torch::Tensor dx = need_dx ? torch::empty_like(x) : torch::Tensor();
    torch::Tensor partial = need_dw ? torch::zeros({blocks, n}, w.options()) : torch::Tensor();
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm_bwd", [&] {
      const scalar_t* xp = x.data_ptr<scalar_t>();
      const scalar_t* wp = w.data_ptr<scalar_t>();
      const scalar_t* rp = r.data_ptr<scalar_t>();
      const scalar_t* gp = dy.data_ptr<scalar_t>();
      scalar_t* dxp = need_dx ? dx.data_ptr<scalar_t>() : nullptr;
      scalar_t* pp = need_dw ? partial.data_ptr<scalar_t>() : nullptr;
      at::parallel_for(0, blocks, 1, [&](int64_t bb, int64_t be) {
        for (int64_t blk = bb; blk < be; ++blk) {
          const int64_t lo = blk * kRowBlock, hi = std::min(rows, lo + kRowBlock);
          for (int64_t i = lo; i < hi; ++i) {
            const scalar_t* xi = xp + i * n;
            const scalar_t* gi = gp + i * n;
            const scalar_t ri = rp[i];
            if (need_dx) {
              double dot = 0;
              for (int64_t j = 0; j < n; ++j) dot += double(gi[j]) * wp[j] * xi[j];
              const scalar_t c = scalar_t(dot * double(ri) * ri * ri / n);
              scalar_t* di = dxp + i * n;
              for (int64_t j = 0; j < n; ++j) di[j] = ri * gi[j] * wp[j] - xi[j] * c;
            }
            if (need_dw) {
              scalar_t* pb = pp + blk * n;
              for (int64_t j = 0; j < n; ++j) pb[j] += gi[j] * xi[j] * ri;
            }
          }
        }
      });
    });
    return {dx, need_dw ? partial.sum(0) : torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

bool fused_cpu_kernel_ok(at::ArrayRef<torch::Tensor> ts) {
  if (at::autocast::is_autocast_enabled(at::kCPU)) return false;
  c10::optional<at::ScalarType> type;
  for (const auto& t : ts) {
    if (!t.defined()) continue;
    if (!t.device().is_cpu()) return false;
    if (t.scalar_type() != torch::kFloat32 && t.scalar_type() != torch::kFloat64) return false;
    if (type && *type != t.scalar_type()) return false;
    type = t.scalar_type();
  }
  return true;
}

torch::Tensor rms_norm_reference(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const auto ct = at::promote_types(x.scalar_type(), torch::kFloat32);
  torch::Tensor xf = x.to(ct);
  torch::Tensor inv = torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (xf * inv * weight.to(ct)).to(x.scalar_type());
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  if (fused_cpu_kernel_ok({x, weight}) && weight.dim() == 1 && weight.size(0) == x.size(-1))
    return RMSNormFn::apply(x, weight, eps);
  if (x.is_cuda()) {  // torch's fused kernel (keeps x and one scalar per row), computed in fp32
    const auto ct = at::promote_types(x.scalar_type(), torch::kFloat32);
    return at::rms_norm(x.to(ct), {x.size(-1)}, weight.to(ct), eps).to(x.scalar_type());
  }
  return rms_norm_reference(x, weight, eps);
}

std::pair<torch::Tensor, torch::Tensor> rope_tables(int64_t max_seq, int64_t head_dim,
                                                    double theta, torch::Device device) {
  auto opts = torch::TensorOptions().dtype(torch::kFloat64);
  // inv_freq[i] = theta^(-2i/hd), i < hd/2; angles[t, i] = t * inv_freq[i]; duplicated halves.
  torch::Tensor inv_freq =
      torch::pow(theta, -torch::arange(0, head_dim, 2, opts) / static_cast<double>(head_dim));
  torch::Tensor t = torch::arange(max_seq, opts);
  torch::Tensor ang = torch::outer(t, inv_freq);
  torch::Tensor emb = torch::cat({ang, ang}, -1);
  return {emb.cos().to(torch::kFloat32).to(device), emb.sin().to(torch::kFloat32).to(device)};
}

torch::Tensor rope_apply(const torch::Tensor& x, const torch::Tensor& cos,
                         const torch::Tensor& sin) {
  const int64_t T = x.size(2), half = x.size(3) / 2;
  torch::Tensor c = cos.narrow(0, 0, T).to(x.scalar_type());
  torch::Tensor s = sin.narrow(0, 0, T).to(x.scalar_type());
  torch::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  torch::Tensor rotated = torch::cat({-x2, x1}, -1);
  return x * c + rotated * s;
}

}  // namespace spes
