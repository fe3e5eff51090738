#!/usr/bin/env python3
"""The same MoE model, loss terms and AdamW as spes, written in PyTorch, timed the same way as
bench/train_bench.cpp (random tokens, full optimizer steps). Prints one JSON line.
--moe grouped runs the experts of a layer as torch._grouped_mm over stacked weights (no host
synchronisation) instead of one product per expert (--moe loop, what a first PyTorch version
would do: the expert sizes go to the host each layer).
--compile runs the model under torch.compile (inductor): with --moe grouped the whole forward;
with --moe loop each region (attention, router, expert, head + loss) on its own, the experts
with dynamic token counts, because compiling the whole forward makes dynamo give up on the layer
loop at the host read of the expert sizes and run it all in eager. The optimizer step and
clipping stay eager in both, as a user writes them.
On a GPU (--device cuda) attention is scaled_dot_product_attention (flash), AdamW is torch's
fused kernel, and --precision amp_bf16 runs under torch.autocast(bfloat16) with fp32 master
weights; frozen experts (--frozen-fraction, as spes) get no gradient and are stored in bf16
under amp_bf16. MFU uses train_bench's FLOP count (frozen experts 4 FLOPs per parameter and
token instead of 6) against --peak-tflops or a matrix-product peak measured here.
Run with the project's PyTorch (the same 2.11 wheel spes is built against): .venv/bin/python."""
import argparse, json, math, re, resource, time
import torch
import torch.nn.functional as F


def rms_norm(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)


def trunc(shape, std=0.02, device="cpu", dtype=torch.float32, grad=True):
    t = torch.empty(shape, device=device)
    torch.nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std)
    return torch.nn.Parameter(t.to(dtype), requires_grad=grad)


class Model(torch.nn.Module):
    def __init__(s, a, dev, frozen_dtype):
        super().__init__()
        D, F_, E, V = a.d_model, a.hidden, a.experts, a.vocab
        s.a = a
        n_frozen = int(a.frozen_fraction * E + 0.5)
        s.embed = trunc((V, D), device=dev)
        s.layers = torch.nn.ModuleList()
        for _ in range(a.layers):
            l = torch.nn.Module()
            for n in ("q", "k", "v", "o"):
                setattr(l, n, trunc((D, D), device=dev))
            l.q_norm = torch.nn.Parameter(torch.ones(D, device=dev))
            l.k_norm = torch.nn.Parameter(torch.ones(D, device=dev))
            l.attn_norm = torch.nn.Parameter(torch.ones(D, device=dev))
            l.mlp_norm = torch.nn.Parameter(torch.ones(D, device=dev))
            l.router = trunc((E, D), device=dev)

            def expert(shape, e):  # the last n_frozen experts of every layer are frozen
                frozen = e >= E - n_frozen
                return trunc(shape, device=dev, dtype=frozen_dtype if frozen else torch.float32,
                             grad=not frozen)

            l.w1 = torch.nn.ParameterList([expert((F_, D), e) for e in range(E)])
            l.v1 = torch.nn.ParameterList([expert((F_, D), e) for e in range(E)])
            l.w2 = torch.nn.ParameterList([expert((D, F_), e) for e in range(E)])
            s.layers.append(l)
        s.norm = torch.nn.Parameter(torch.ones(D, device=dev))
        s.head = trunc((V, D), device=dev)
        hd = D // a.heads
        inv = a.theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = torch.outer(torch.arange(a.seq, dtype=torch.float64), inv)
        emb = torch.cat([ang, ang], -1)
        s.register_buffer("cos", emb.cos().float().to(dev))
        s.register_buffer("sin", emb.sin().float().to(dev))

    def forward(s, tok, tgt):
        a = s.a
        B, T = tok.shape
        D = a.d_model
        x = s.embed[tok]
        lb = 0.0
        rz = 0.0
        cos, sin = s.cos[:T], s.sin[:T]
        for l in s.layers:
            x = x + KERNELS["attention"](x, l.attn_norm, l.q, l.k, l.v, l.o, l.q_norm, l.k_norm,
                                         cos, sin, a.heads)
            hn, logits, p, w, idx = KERNELS["router"](x.reshape(-1, D), l.mlp_norm, l.router,
                                                      a.top_k)
            flat = idx.reshape(-1)
            order = torch.sort(flat, stable=True)[1]
            tok_of = order // a.top_k
            sw = w.reshape(-1)[order]
            counts = torch.bincount(flat, minlength=a.experts)
            xs = hn[tok_of]
            if a.moe == "grouped":
                ys = grouped_experts(xs, counts, l.w1, l.v1, l.w2)
            else:
                outs, start = [], 0
                for e, c in enumerate(counts.tolist()):
                    if c == 0:
                        continue
                    outs.append(KERNELS["expert"](xs[start:start + c], l.w1[e], l.v1[e], l.w2[e]))
                    start += c
                ys = torch.cat(outs)
            ys = ys * sw.unsqueeze(1).to(ys.dtype)
            x = x + torch.zeros_like(hn, dtype=ys.dtype).index_add(0, tok_of, ys).view(B, T, D)
            lb = lb + (counts.float() * p.mean(0)).sum()
            rz = rz + torch.logsumexp(logits, -1).pow(2).mean()
        lb = lb * a.experts / (a.layers * B * T * a.top_k)
        return KERNELS["head_loss"](x.reshape(-1, D), s.norm, s.head, tgt.reshape(-1)) + \
            0.01 * lb + 0.001 * rz


def rope(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos.to(x.dtype) + torch.cat([-x[..., h:], x[..., :h]], -1) * sin.to(x.dtype)


def attention(x, attn_norm, wq, wk, wv, wo, q_norm, k_norm, cos, sin, heads):
    B, T, D = x.shape
    h = rms_norm(x, attn_norm)
    q = rms_norm(h @ wq.t(), q_norm).view(B, T, heads, -1).transpose(1, 2)
    k = rms_norm(h @ wk.t(), k_norm).view(B, T, heads, -1).transpose(1, 2)
    v = (h @ wv.t()).view(B, T, heads, -1).transpose(1, 2)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    if x.is_cuda:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        sc = (q @ k.transpose(-2, -1)) / math.sqrt(D // heads)
        y = torch.softmax(sc.masked_fill(mask, float("-inf")), -1) @ v
    return y.transpose(1, 2).reshape(B, T, D) @ wo.t()


def router(x, mlp_norm, w_router, top_k):
    hn = rms_norm(x, mlp_norm)
    logits = (hn @ w_router.t()).float()
    p = torch.softmax(logits, -1)
    w, idx = p.topk(top_k, -1)
    return hn, logits, p, w, idx


def expert(xe, w1, v1, w2):  # (autocast casts these products to bf16 under amp_bf16)
    return (F.silu(xe @ w1.t()) * (xe @ v1.t())) @ w2.t()


def grouped_experts(xs, counts, w1s, v1s, w2s):
    """All experts of a layer over tokens sorted by expert, three grouped products."""
    cd = torch.bfloat16 if torch.is_autocast_enabled(xs.device.type) else xs.dtype
    offs = counts.cumsum(0).to(torch.int32)
    w1 = torch.stack([w.to(cd) for w in w1s])      # [E, F, D]
    v1 = torch.stack([w.to(cd) for w in v1s])
    w2 = torch.stack([w.to(cd) for w in w2s])      # [E, D, F]
    xc = xs.to(cd)
    g = torch._grouped_mm(xc, w1.transpose(1, 2), offs)
    u = torch._grouped_mm(xc, v1.transpose(1, 2), offs)
    return torch._grouped_mm(F.silu(g) * u, w2.transpose(1, 2), offs)


def head_loss(x, norm, head, tgt):
    lg = (rms_norm(x, norm) @ head.t()).float()
    lse = torch.logsumexp(lg, -1)
    ce = (lse - lg.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)).mean()
    return ce + 1e-4 * lse.pow(2).mean()


# The model's regions; compile_regions() replaces them with torch.compile'd versions.
KERNELS = {"attention": attention, "router": router, "expert": expert, "head_loss": head_loss}


def compile_regions():
    for name in ("attention", "router", "head_loss"):
        KERNELS[name] = torch.compile(KERNELS[name])
    KERNELS["expert"] = torch.compile(KERNELS["expert"], dynamic=True)


def flops_per_token(a):
    """train_bench.cpp's count: 6 per active parameter and token (4 for frozen experts)."""
    D, F_ = a.d_model, a.hidden
    n_frozen = int(a.frozen_fraction * a.experts + 0.5)
    frozen_share = n_frozen / a.experts
    shared = 4 * D * D + a.experts * D
    expert = a.top_k * 3 * D * F_
    per_layer = 6 * shared + expert * (6 * (1 - frozen_share) + 4 * frozen_share)
    return a.layers * per_layer + 6.0 * a.vocab * D + 12.0 * a.layers * a.seq * D


def gpu_matmul_peak(dev, dtype, n=8192, reps=5):
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        best = max(best, 10 * 2.0 * n ** 3 / (time.perf_counter() - t0))
    return best


def main():
    ap = argparse.ArgumentParser()
    for k, v in dict(d_model=512, layers=8, heads=8, experts=8, top_k=2, hidden=1024, vocab=8192,
                     seq=256, batch=8, steps=5, warmup=0, threads=2).items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    ap.add_argument("--theta", type=float, default=500000.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "amp_bf16"])
    ap.add_argument("--compile", action="store_true", help="run the model under torch.compile")
    ap.add_argument("--moe", default="loop", choices=["loop", "grouped"])
    ap.add_argument("--frozen-fraction", type=float, default=0.0)
    ap.add_argument("--peak-tflops", type=float, default=0.0)
    ap.add_argument("--name", default="")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    bf16 = a.precision == "amp_bf16"
    m = Model(a, dev, torch.bfloat16 if bf16 else torch.float32)
    trainable = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=cuda or None)
    run = m
    if a.compile and a.moe == "grouped":
        run = torch.compile(m)
    elif a.compile:
        compile_regions()
    a.warmup = a.warmup or (3 if a.compile else 2)  # untimed steps (compilation happens here)

    def step():
        tok = torch.randint(a.vocab, (a.batch, a.seq), device=dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            loss = run(tok, torch.roll(tok, -1, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    t_first = time.perf_counter()
    for _ in range(a.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
    warmup_s = time.perf_counter() - t_first
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / a.steps
    tok_s = a.batch * a.seq / dt
    out = {"name": a.name or ("pytorch_compile" if a.compile else "pytorch_eager"),
           "torch": torch.__version__, "device": str(dev), "precision": a.precision,
           "compile": a.compile, "moe": a.moe, "threads": a.threads, "layers": a.layers,
           "blas": re.search(r"BLAS_INFO=(\w+)", torch.__config__.show()).group(1),
           "frozen_experts_per_layer": int(a.frozen_fraction * a.experts + 0.5),
           "step_s": dt, "tokens_per_s": tok_s, "warmup_s": warmup_s,
           "flops_per_token": flops_per_token(a),
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if cuda:
        out["gpu_peak_allocated_mb"] = torch.cuda.max_memory_allocated(dev) / 2 ** 20
        peak = a.peak_tflops * 1e12 or gpu_matmul_peak(
            dev, torch.bfloat16 if bf16 else torch.float32)
        out["gemm_peak_gflops"] = peak / 1e9
        out["mfu"] = tok_s * out["flops_per_token"] / peak
    print(json.dumps(out))


if __name__ == "__main__":
    main()
