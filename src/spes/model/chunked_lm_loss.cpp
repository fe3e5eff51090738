// LM head + cross-entropy + output z-loss in chunks of rows, for any device and dtype (the fused
// CPU kernel of losses.cpp stays for fp32/fp64 on CPU). No [N, V] tensor exists beyond one chunk
// of rows: each chunk's logits are computed (bf16 operands, fp32 results under amp_bf16), reduced
// (logsumexp, target logit) and turned in place into the gradient of ce + z_weight * z, whose
// products with the head and the hidden states are accumulated right away (the head's dW in
// fp32); backward only scales them by the incoming gradient. So the logits are computed once,
// not recomputed in backward. On CUDA, when the head is converted for the products anyway
// (amp_bf16), the converted copy is padded with zero rows to a multiple of 64 vocabulary
// entries: every product then has leading dimensions cuBLAS can vectorise (an odd vocabulary
// such as 151665 otherwise gets its slow align-1 kernels; docs/PERFORMANCE.md); the padded
// logits are left out of every reduction and their gradient is zero. Leaves out: a
// vocabulary-parallel head.
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <atomic>

#include "spes/common/error.h"
#include "spes/model/layers.h"
#include "spes/model/losses.h"

namespace spes {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// Logits chunks stay near this size (fp32): large enough for an efficient GEMM.
constexpr int64_t kChunkBytes = int64_t{256} << 20;
// Rows the converted head is padded to on CUDA (64 bf16 values: 128 bytes).
constexpr int64_t kCudaVocabMultiple = 64;

// Whether this device's torch multiplies bf16/fp16 operands into an fp32 result (CUDA's
// mm.dtype); probed once.
bool cuda_mm_out_dtype_works() {
  static std::atomic<int> state{-1};
  int s = state.load();
  if (s < 0) {
    try {
      auto o = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
      torch::Tensor r = at::mm(torch::ones({16, 16}, o), torch::ones({16, 16}, o), torch::kFloat);
      s = r.scalar_type() == torch::kFloat ? 1 : 0;
    } catch (const std::exception&) {
      s = 0;
    }
    state.store(s);
  }
  return s == 1;
}

bool low_precision(const torch::Tensor& t) {
  return t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf;
}

// a @ b with an fp32 (or wider) result.
torch::Tensor mm_wide(const torch::Tensor& a, const torch::Tensor& b) {
  if (!low_precision(a)) return at::mm(a, b);
  if (a.is_cuda() && cuda_mm_out_dtype_works()) return at::mm(a, b, torch::kFloat);
  return at::mm(a.to(torch::kFloat), b.to(torch::kFloat));
}

// acc += a @ b with acc wider than (or as wide as) a and b.
void addmm_wide_(torch::Tensor& acc, const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() == acc.scalar_type()) {
    acc.addmm_(a, b);
  } else if (a.is_cuda() && acc.scalar_type() == torch::kFloat && cuda_mm_out_dtype_works()) {
    at::addmm_out(acc, acc, a, b, torch::kFloat);
  } else {
    acc.addmm_(a.to(acc.scalar_type()), b.to(acc.scalar_type()));
  }
}

// `w` converted to `cd`, with zero rows appended up to a multiple of `multiple` rows.
torch::Tensor head_for_products(const torch::Tensor& w, torch::ScalarType cd, int64_t multiple) {
  const int64_t V = w.size(0), padded = (V + multiple - 1) / multiple * multiple;
  if (padded == V) return w.to(cd).contiguous();
  torch::Tensor out = torch::zeros({padded, w.size(1)}, w.options().dtype(cd));
  out.narrow(0, 0, V).copy_(w);
  return out;
}

struct ChunkedLmHeadLossFn : public torch::autograd::Function<ChunkedLmHeadLossFn> {
  // Returns {ce + z_weight * z (differentiable), ce, z} (the last two for logging).
  static tensor_list forward(AutogradContext* ctx, const torch::Tensor& h,
                             const torch::Tensor& w, const torch::Tensor& targets,
                             double z_weight, int64_t chunk_rows, int64_t compute_dtype,
                             int64_t vocab_multiple, bool need_grad) {
    // Dtypes are chosen here, not by autocast (which would cast the fp32 products down).
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto cd = static_cast<torch::ScalarType>(compute_dtype);
    const torch::ScalarType acc = at::promote_types(cd, torch::kFloat32);
    torch::Tensor hc = h.to(cd).contiguous(), wc = head_for_products(w, cd, vocab_multiple);
    const int64_t N = h.size(0), V = w.size(0), Vp = wc.size(0);
    torch::Tensor safe_t = targets.clamp_min(0);
    torch::Tensor mask = (targets >= 0).to(acc);
    torch::Tensor n = mask.sum().clamp_min(1.0);
    torch::Tensor ce_sum = torch::zeros({}, mask.options()), z_sum = torch::zeros({}, mask.options());
    torch::Tensor dh, dw;
    if (need_grad) {
      dh = torch::empty_like(hc);
      dw = torch::zeros({Vp, w.size(1)}, wc.options().dtype(acc));
    }
    const int64_t rows = chunk_rows > 0 ? chunk_rows : lm_head_default_chunk_rows(V);
    for (int64_t r0 = 0; r0 < N; r0 += rows) {
      const int64_t nr = std::min(rows, N - r0);
      torch::Tensor hr = hc.narrow(0, r0, nr), tr = safe_t.narrow(0, r0, nr).unsqueeze(1);
      torch::Tensor mr = mask.narrow(0, r0, nr);
      torch::Tensor padded_logits = mm_wide(hr, wc.t());  // [nr, Vp]
      torch::Tensor logits = padded_logits.narrow(1, 0, V);
      torch::Tensor lse = at::logsumexp(logits, 1);
      torch::Tensor tgt = logits.gather(1, tr).squeeze(1);
      ce_sum.add_(((lse - tgt) * mr).sum());
      z_sum.add_((lse * lse * mr).sum());
      if (!need_grad) continue;
      // d(ce + zw z)/dlogits = softmax * m (1 + 2 zw lse) / n - onehot * m / n, in place.
      torch::Tensor d = logits;
      d.sub_(lse.unsqueeze(1)).exp_().mul_((mr * (1.0 + 2.0 * z_weight * lse) / n).unsqueeze(1));
      d.scatter_add_(1, tr, (-mr / n).unsqueeze(1));
      if (Vp > V) padded_logits.narrow(1, V, Vp - V).zero_();  // no gradient for padding
      torch::Tensor dc = padded_logits.to(cd);
      torch::Tensor dhr = dh.narrow(0, r0, nr);
      at::mm_out(dhr, dc, wc);
      addmm_wide_(dw, dc.t(), hr);
    }
    torch::Tensor ce = ce_sum / n, z = z_sum / n;
    torch::Tensor total = ce + z_weight * z;
    ctx->mark_non_differentiable({ce, z});
    if (need_grad) {
      ctx->saved_data["dh"] = dh;
      ctx->saved_data["dw"] = dw.narrow(0, 0, V);  // rows of a [Vp, D] tensor: contiguous
    }
    ctx->saved_data["h_dtype"] = static_cast<int64_t>(h.scalar_type());
    ctx->save_for_backward({w});
    return {total, ce, z};
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    SPES_CHECK(ctx->saved_data.count("dh"), "the chunked LM-head loss was differentiated without "
               "gradients prepared in its forward pass, or twice (retain_graph is not supported)");
    torch::Tensor dh = ctx->saved_data["dh"].toTensor(), dw = ctx->saved_data["dw"].toTensor();
    ctx->saved_data.erase("dh");
    ctx->saved_data.erase("dw");
    const torch::Tensor w = ctx->get_saved_variables()[0];
    const auto h_dtype = static_cast<torch::ScalarType>(ctx->saved_data["h_dtype"].toInt());
    torch::Tensor g = grads[0].defined() ? grads[0] : torch::zeros({}, dw.options());
    torch::Tensor dh_out, dw_out;
    if (ctx->needs_input_grad(0)) dh_out = dh.mul_(g.to(dh.scalar_type())).to(h_dtype);
    if (ctx->needs_input_grad(1)) {
      dw.mul_(g.to(dw.scalar_type()));
      const torch::Tensor& buf = w.grad();
      if (!torch::GradMode::is_enabled() && w.is_leaf() && buf.defined() &&
          buf.is_contiguous() && buf.sizes() == w.sizes()) {
        buf.add_(dw);  // into the persistent gradient buffer: no second [V, D] tensor
      } else {
        dw_out = dw.to(w.scalar_type());
      }
    }
    return {dh_out, dw_out, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::ScalarType autocast_compute_dtype(const torch::Tensor& t) {
  const auto dev = t.device().type();
  if ((dev == at::kCUDA || dev == at::kCPU) && at::autocast::is_autocast_enabled(dev))
    return at::autocast::get_autocast_dtype(dev);
  return t.scalar_type();
}

int64_t lm_head_vocab_multiple(const torch::Tensor& h, const torch::Tensor& lm_head) {
  const bool converted = autocast_compute_dtype(h) != lm_head.scalar_type();
  return h.is_cuda() && converted ? kCudaVocabMultiple : 1;
}

LmHeadLoss lm_head_losses_chunked(const torch::Tensor& h, const torch::Tensor& lm_head,
                                  const torch::Tensor& targets, double z_weight,
                                  int64_t chunk_rows, int64_t vocab_multiple) {
  SPES_CHECK(h.dim() == 2 && lm_head.dim() == 2 && h.size(1) == lm_head.size(1),
             "internal: LM-head loss wants h [N, D] and a head [V, D]");
  const bool need_grad =
      torch::GradMode::is_enabled() && (h.requires_grad() || lm_head.requires_grad());
  SPES_CHECK(vocab_multiple >= 0, "internal: negative vocabulary multiple");
  if (vocab_multiple == 0) vocab_multiple = lm_head_vocab_multiple(h, lm_head);
  auto r = ChunkedLmHeadLossFn::apply(h, lm_head, targets, z_weight, chunk_rows,
                                      static_cast<int64_t>(autocast_compute_dtype(h)),
                                      vocab_multiple, need_grad);
  return {r[0], r[1], r[2]};
}

int64_t lm_head_default_chunk_rows(int64_t vocab) {
  return std::max<int64_t>(64, kChunkBytes / (4 * vocab));
}

}  // namespace spes
