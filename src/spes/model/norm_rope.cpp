// RMSNorm (fp32) and rotate-half rotary position embeddings.
#include "spes/model/layers.h"

namespace spes {

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const auto ct = at::promote_types(x.scalar_type(), torch::kFloat32);
  torch::Tensor xf = x.to(ct);
  torch::Tensor inv = torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (xf * inv * weight.to(ct)).to(x.scalar_type());
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
