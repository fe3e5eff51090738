// Causal multi-head attention with optional GQA, whole-vector (OLMoE) or per-head (Qwen3)
// QK-norm and rotate-half RoPE. Uses scaled_dot_product_attention where libtorch has it
// (2.x); on CPU (fp32/fp64) one fused autograd node with RoPE and block-causal GEMMs; otherwise
// an explicit softmax(QK^T/sqrt(d) + causal mask) V.
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "spes/model/kernel_parallel.h"
#include "spes/model/layers.h"

namespace spes {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// Rows of queries per block of the causal attention kernel: block i attends to keys
// [0, (i+1) * kBlock) only, so about half of QK^T and PV (and of their gradients) is skipped.
constexpr int64_t kAttnBlock = 64;

// Rotate-half RoPE of one [T, hd] head (row stride ld) into a contiguous [T, hd] buffer.
template <typename T>
void rope_rows(const T* x, int64_t ld, const float* c, const float* s, T* out, int64_t rows,
               int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t t = 0; t < rows; ++t) {
    const T* xi = x + t * ld;
    const float* ci = c + t * hd;
    const float* si = s + t * hd;
    T* oi = out + t * hd;
    for (int64_t d = 0; d < half; ++d) oi[d] = xi[d] * T(ci[d]) - xi[d + half] * T(si[d]);
    for (int64_t d = half; d < hd; ++d) oi[d] = xi[d] * T(ci[d]) + xi[d - half] * T(si[d]);
  }
}

// Transpose of rope_rows: gradient wrt the unrotated input from the gradient wrt the rotated.
template <typename T>
void rope_rows_backward(const T* g, const float* c, const float* s, T* out, int64_t ld,
                        int64_t rows, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t t = 0; t < rows; ++t) {
    const T* gi = g + t * hd;
    const float* ci = c + t * hd;
    const float* si = s + t * hd;
    T* oi = out + t * ld;
    for (int64_t d = 0; d < half; ++d) oi[d] = gi[d] * T(ci[d]) + gi[d + half] * T(si[d + half]);
    for (int64_t d = half; d < hd; ++d) oi[d] = gi[d] * T(ci[d]) - gi[d - half] * T(si[d - half]);
  }
}

// Offset of query block i in the packed probabilities of one head (blocks of kAttnBlock rows
// by the keys they see, stored one after the other), and the packed size.
int64_t block_offset(int64_t i, int64_t T) {
  int64_t off = 0;
  for (int64_t b = 0; b < i; ++b) {
    const int64_t i0 = b * kAttnBlock, i1 = std::min(T, i0 + kAttnBlock);
    off += (i1 - i0) * i1;
  }
  return off;
}

// softmax(rope(q) rope(k)^T / sqrt(hd) + causal mask) v for q, k, v [B, H, T, hd] (any
// strides with a unit last stride; the same number of heads: GQA expands k, v before). One
// autograd node; each (batch, head) pair is one task (single-threaded GEMMs inside), query
// blocks only multiply the keys they can see, and the probabilities are kept packed (about
// 5/8 of B*H*T*T for T = 256). The output is [B, H, T, hd] laid out as [B, T, H, hd], so
// that the caller's transpose + reshape to [B, T, H*hd] is free.
struct CausalAttentionFn : public torch::autograd::Function<CausalAttentionFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q_,
                               const torch::Tensor& k_, const torch::Tensor& v_,
                               const torch::Tensor& cos, const torch::Tensor& sin, bool rope) {
    auto unit = [](const torch::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
    torch::Tensor q = unit(q_), k = unit(k_), v = unit(v_);
    const int64_t B = q.size(0), H = q.size(1), T = q.size(2), hd = q.size(3);
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    const int64_t packed = block_offset((T + kAttnBlock - 1) / kAttnBlock, T);
    auto opts = q.options();
    torch::Tensor qr = torch::empty({B, H, T, hd}, opts), kr = torch::empty({B, H, T, hd}, opts);
    torch::Tensor probs = torch::empty({B, H, packed}, opts);
    torch::Tensor out = torch::empty({B, T, H, hd}, opts).transpose(1, 2);
    torch::Tensor c, s;
    if (rope) {
      c = cos.narrow(0, 0, T).to(torch::kFloat32).contiguous();
      s = sin.narrow(0, 0, T).to(torch::kFloat32).contiguous();
    }
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "causal_attention_fwd", [&] {
      parallel_for_in_grad_mode(0, B * H, 1, [&](int64_t pb, int64_t pe) {
        for (int64_t p = pb; p < pe; ++p) {
          const int64_t b = p / H, h = p % H;
          torch::Tensor qh = qr[b][h], kh = kr[b][h], vh = v[b][h], oh = out[b][h];
          if (rope) {
            rope_rows(q[b][h].data_ptr<scalar_t>(), q.stride(2), c.data_ptr<float>(),
                      s.data_ptr<float>(), qh.data_ptr<scalar_t>(), T, hd);
            rope_rows(k[b][h].data_ptr<scalar_t>(), k.stride(2), c.data_ptr<float>(),
                      s.data_ptr<float>(), kh.data_ptr<scalar_t>(), T, hd);
          } else {
            qh.copy_(q[b][h]);
            kh.copy_(k[b][h]);
          }
          torch::Tensor ph = probs[b][h];
          torch::Tensor scratch = torch::empty({kAttnBlock * T}, opts);
          int64_t off = 0;
          for (int64_t i0 = 0; i0 < T; i0 += kAttnBlock) {
            const int64_t i1 = std::min(T, i0 + kAttnBlock), n = i1 - i0;
            torch::Tensor sc = scratch.narrow(0, 0, n * i1).view({n, i1});
            torch::mm_out(sc, qh.narrow(0, i0, n), kh.narrow(0, 0, i1).t());
            scalar_t* sp = sc.data_ptr<scalar_t>();
            for (int64_t r = 0; r < n; ++r) {
              scalar_t* row = sp + r * i1;
              const int64_t last = i0 + r;  // keys 0..last are visible
              for (int64_t j = 0; j <= last; ++j) row[j] *= scalar_t(scale);
              for (int64_t j = last + 1; j < i1; ++j)
                row[j] = -std::numeric_limits<scalar_t>::infinity();
            }
            torch::Tensor pbk = ph.narrow(0, off, n * i1).view({n, i1});
            at::_softmax_out(pbk, sc, 1, false);
            torch::Tensor ob = oh.narrow(0, i0, n);
            torch::mm_out(ob, pbk, vh.narrow(0, 0, i1));
            off += n * i1;
          }
        }
      });
    });
    ctx->save_for_backward({qr, kr, v, probs, c, s});
    ctx->saved_data["rope"] = rope;
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    torch::Tensor qr = saved[0], kr = saved[1], v = saved[2], probs = saved[3], c = saved[4],
                  s = saved[5];
    const bool rope = ctx->saved_data["rope"].toBool();
    torch::Tensor dout = grads[0].stride(-1) == 1 ? grads[0] : grads[0].contiguous();
    const int64_t B = qr.size(0), H = qr.size(1), T = qr.size(2), hd = qr.size(3);
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    auto opts = qr.options();
    // Gradients laid out [B, T, H, hd] (as the projections that produced q, k, v).
    torch::Tensor dq = torch::empty({B, T, H, hd}, opts).transpose(1, 2);
    torch::Tensor dk = torch::empty({B, T, H, hd}, opts).transpose(1, 2);
    torch::Tensor dv = torch::empty({B, T, H, hd}, opts).transpose(1, 2);
    AT_DISPATCH_FLOATING_TYPES(qr.scalar_type(), "causal_attention_bwd", [&] {
      parallel_for_in_grad_mode(0, B * H, 1, [&](int64_t pb, int64_t pe) {
        for (int64_t p = pb; p < pe; ++p) {
          const int64_t b = p / H, h = p % H;
          torch::Tensor qh = qr[b][h], kh = kr[b][h], vh = v[b][h], doh = dout[b][h];
          torch::Tensor ph = probs[b][h];
          torch::Tensor dqr = torch::empty({T, hd}, opts), dkr = torch::zeros({T, hd}, opts);
          torch::Tensor dvh = dv[b][h];
          dvh.zero_();
          int64_t off = 0;
          for (int64_t i0 = 0; i0 < T; i0 += kAttnBlock) {
            const int64_t i1 = std::min(T, i0 + kAttnBlock), n = i1 - i0;
            torch::Tensor pbk = ph.narrow(0, off, n * i1).view({n, i1});
            torch::Tensor dO = doh.narrow(0, i0, n);
            torch::Tensor ds = torch::mm(dO, vh.narrow(0, 0, i1).t());  // dP, becomes dS
            dvh.narrow(0, 0, i1).addmm_(pbk.t(), dO);
            const scalar_t* pp = pbk.data_ptr<scalar_t>();
            scalar_t* dp = ds.data_ptr<scalar_t>();
            for (int64_t r = 0; r < n; ++r) {
              const scalar_t* prow = pp + r * i1;
              scalar_t* drow = dp + r * i1;
              const int64_t last = i0 + r;
              double dot = 0;
              for (int64_t j = 0; j <= last; ++j) dot += double(prow[j]) * drow[j];
              const scalar_t sd = scalar_t(dot);
              for (int64_t j = 0; j <= last; ++j)
                drow[j] = prow[j] * (drow[j] - sd) * scalar_t(scale);
              for (int64_t j = last + 1; j < i1; ++j) drow[j] = 0;
            }
            torch::Tensor dqb = dqr.narrow(0, i0, n);
            torch::mm_out(dqb, ds, kh.narrow(0, 0, i1));
            dkr.narrow(0, 0, i1).addmm_(ds.t(), qh.narrow(0, i0, n));
            off += n * i1;
          }
          torch::Tensor dqh = dq[b][h], dkh = dk[b][h];
          if (rope) {
            rope_rows_backward(dqr.data_ptr<scalar_t>(), c.data_ptr<float>(),
                               s.data_ptr<float>(), dqh.data_ptr<scalar_t>(), dq.stride(2), T,
                               hd);
            rope_rows_backward(dkr.data_ptr<scalar_t>(), c.data_ptr<float>(),
                               s.data_ptr<float>(), dkh.data_ptr<scalar_t>(), dk.stride(2), T,
                               hd);
          } else {
            dqh.copy_(dqr);
            dkh.copy_(dkr);
          }
        }
      });
    });
    return {dq, dk, dv, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor fused_causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const torch::Tensor& cos,
                                     const torch::Tensor& sin, bool rope) {
  const int64_t H = q.size(1), Hkv = k.size(1);
  torch::Tensor kk = k, vv = v;
  if (Hkv != H) {
    kk = k.repeat_interleave(H / Hkv, 1);
    vv = v.repeat_interleave(H / Hkv, 1);
  }
  if (!rope) {  // the node's tensor arguments must be defined
    torch::Tensor none = torch::empty({0});
    return CausalAttentionFn::apply(q, kk, vv, none, none, false);
  }
  return CausalAttentionFn::apply(q, kk, vv, cos, sin, true);
}

bool fused_attention_ok(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  return q.dim() == 4 && q.size(-1) % 2 == 0 && fused_cpu_kernel_ok({q, k, v});
}

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v) {
  if (fused_attention_ok(q, k, v)) return fused_causal_attention(q, k, v, {}, {}, false);
  return causal_attention_reference(q, k, v);
}

torch::Tensor causal_attention_reference(const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v) {
  const int64_t H = q.size(1), Hkv = k.size(1);
  if (q.is_cuda())  // flash / memory-efficient kernels read the shared K/V heads directly
    return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, std::nullopt,
                                            /*enable_gqa=*/Hkv != H);
  torch::Tensor kk = k, vv = v;
  if (Hkv != H) {
    kk = k.repeat_interleave(H / Hkv, 1);
    vv = v.repeat_interleave(H / Hkv, 1);
  }
  return at::scaled_dot_product_attention(q, kk, vv, {}, 0.0, /*is_causal=*/true);
}

torch::Tensor attention_forward(const BlockWeights& b, const torch::Tensor& x,
                                const ModelConfig& cfg, const torch::Tensor& cos,
                                const torch::Tensor& sin) {
  const int64_t B = x.size(0), T = x.size(1), H = cfg.n_heads, Hkv = cfg.kv_heads();
  const int64_t hd = cfg.head_dim();
  // Under autocast, cast the normed input once (autocast would cast it for each projection and
  // each product would keep its own bf16 copy for backward). No-op otherwise.
  const torch::Tensor xc = x.to(autocast_compute_dtype(x));
  torch::Tensor q = torch::matmul(xc, b.q.t());
  torch::Tensor k = torch::matmul(xc, b.k.t());
  torch::Tensor v = torch::matmul(xc, b.v.t());
  if (cfg.qk_norm == QkNorm::Whole) {
    q = rms_norm(q, b.q_norm, cfg.layer_norm_eps);
    k = rms_norm(k, b.k_norm, cfg.layer_norm_eps);
  }
  q = q.view({B, T, H, hd});
  k = k.view({B, T, Hkv, hd});
  if (cfg.qk_norm == QkNorm::PerHead) {
    q = rms_norm(q, b.q_norm, cfg.layer_norm_eps);
    k = rms_norm(k, b.k_norm, cfg.layer_norm_eps);
  }
  v = v.view({B, T, Hkv, hd}).transpose(1, 2);
  torch::Tensor y;  // [B, H, T, hd]
  if (fused_attention_ok(q, k, v)) {
    y = fused_causal_attention(q.transpose(1, 2), k.transpose(1, 2), v, cos, sin, true);
  } else {
    q = rope_apply(q.transpose(1, 2), cos, sin);
    k = rope_apply(k.transpose(1, 2), cos, sin);
    y = causal_attention(q, k, v);
  }
  y = y.transpose(1, 2).reshape({B, T, H * hd});
  return torch::matmul(y, b.o.t());
}

}  // namespace spes
