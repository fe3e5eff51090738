#!/usr/bin/env python3
"""The same MoE model, loss terms and AdamW as spes, written in PyTorch, timed the same way as
bench/train_bench.cpp (random tokens, full optimizer steps). Prints one JSON line.
--compile runs the model's regions (attention, router, experts, head + loss, forward and
backward) under torch.compile (inductor) instead of eager; the expert dispatch, optimizer step
and clipping stay eager in both, as a user writes them.
Run with the project's PyTorch (the same 2.11 wheel spes is built against): .venv/bin/python."""
import argparse, json, math, re, resource, time
import torch
import torch.nn.functional as F


def rms_norm(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)


def trunc(shape, std=0.02):
    t = torch.empty(shape)
    torch.nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std)
    return torch.nn.Parameter(t)


class Model(torch.nn.Module):
    def __init__(s, a):
        super().__init__()
        D, F_, E, V = a.d_model, a.hidden, a.experts, a.vocab
        s.a = a
        s.embed = trunc((V, D))
        s.layers = torch.nn.ModuleList()
        for _ in range(a.layers):
            l = torch.nn.Module()
            for n in ("q", "k", "v", "o"):
                setattr(l, n, trunc((D, D)))
            l.q_norm = torch.nn.Parameter(torch.ones(D))
            l.k_norm = torch.nn.Parameter(torch.ones(D))
            l.attn_norm = torch.nn.Parameter(torch.ones(D))
            l.mlp_norm = torch.nn.Parameter(torch.ones(D))
            l.router = trunc((E, D))
            l.w1 = torch.nn.ParameterList([trunc((F_, D)) for _ in range(E)])
            l.v1 = torch.nn.ParameterList([trunc((F_, D)) for _ in range(E)])
            l.w2 = torch.nn.ParameterList([trunc((D, F_)) for _ in range(E)])
            s.layers.append(l)
        s.norm = torch.nn.Parameter(torch.ones(D))
        s.head = trunc((V, D))
        hd = D // a.heads
        inv = a.theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = torch.outer(torch.arange(a.seq, dtype=torch.float64), inv)
        emb = torch.cat([ang, ang], -1)
        s.cos, s.sin = emb.cos().float(), emb.sin().float()

    def forward(s, tok, tgt):
        a = s.a
        B, T = tok.shape
        D = a.d_model
        x = s.embed[tok]
        lb = 0.0
        rz = 0.0
        for l in s.layers:
            x = x + KERNELS["attention"](x, l.attn_norm, l.q, l.k, l.v, l.o, l.q_norm, l.k_norm,
                                         s.cos[:T], s.sin[:T], a.heads)
            hn, logits, p, w, idx = KERNELS["router"](x.reshape(-1, D), l.mlp_norm, l.router,
                                                      a.top_k)
            flat = idx.reshape(-1)
            order = torch.sort(flat, stable=True)[1]
            tok_of = order // a.top_k
            sw = w.reshape(-1)[order]
            counts = torch.bincount(flat, minlength=a.experts)
            xs = hn[tok_of]
            outs, start = [], 0
            for e, c in enumerate(counts.tolist()):
                if c == 0:
                    continue
                outs.append(KERNELS["expert"](xs[start:start + c], l.w1[e], l.v1[e], l.w2[e]))
                start += c
            ys = torch.cat(outs) * sw.unsqueeze(1)
            x = x + torch.zeros_like(hn).index_add(0, tok_of, ys).view(B, T, D)
            lb = lb + (counts.float() * p.mean(0)).sum()
            rz = rz + torch.logsumexp(logits, -1).pow(2).mean()
        lb = lb * a.experts / (a.layers * B * T * a.top_k)
        return KERNELS["head_loss"](x.reshape(-1, D), s.norm, s.head, tgt.reshape(-1)) + \
            0.01 * lb + 0.001 * rz


def rope(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin


def attention(x, attn_norm, wq, wk, wv, wo, q_norm, k_norm, cos, sin, heads):
    B, T, D = x.shape
    h = rms_norm(x, attn_norm)
    q = rms_norm(h @ wq.t(), q_norm).view(B, T, heads, -1).transpose(1, 2)
    k = rms_norm(h @ wk.t(), k_norm).view(B, T, heads, -1).transpose(1, 2)
    v = (h @ wv.t()).view(B, T, heads, -1).transpose(1, 2)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
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


def expert(xe, w1, v1, w2):
    return (F.silu(xe @ w1.t()) * (xe @ v1.t())) @ w2.t()


def head_loss(x, norm, head, tgt):
    lg = rms_norm(x, norm) @ head.t()
    lse = torch.logsumexp(lg, -1)
    ce = (lse - lg.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)).mean()
    return ce + 1e-4 * lse.pow(2).mean()


# The model's pieces; --compile replaces them with torch.compile'd versions. The data-dependent
# expert dispatch (token counts read on the host) stays eager either way: compiling the whole
# forward makes dynamo give up on the layer loop at that graph break and run it all in eager.
# So each region is compiled on its own, the experts with dynamic token counts.
KERNELS = {"attention": attention, "router": router, "expert": expert, "head_loss": head_loss}


def compile_kernels():
    for name in ("attention", "router", "head_loss"):
        KERNELS[name] = torch.compile(KERNELS[name])
    KERNELS["expert"] = torch.compile(KERNELS["expert"], dynamic=True)


def main():
    ap = argparse.ArgumentParser()
    for k, v in dict(d_model=512, layers=8, heads=8, experts=8, top_k=2, hidden=1024, vocab=8192,
                     seq=256, batch=8, steps=5, warmup=0, threads=2).items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    ap.add_argument("--theta", type=float, default=500000.0)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    ap.add_argument("--name", default="", help="name in the JSON line (default: pytorch_eager "
                    "or pytorch_compile)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    m = Model(a)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1)
    if a.compile:
        compile_kernels()
    a.warmup = a.warmup or (3 if a.compile else 2)  # untimed steps (compilation happens here)

    def step():
        tok = torch.randint(a.vocab, (a.batch, a.seq))
        loss = m(tok, torch.roll(tok, -1, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    t_compile = time.perf_counter()
    for _ in range(a.warmup):
        step()
    warmup_s = time.perf_counter() - t_compile
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    dt = (time.perf_counter() - t0) / a.steps
    name = a.name or ("pytorch_compile" if a.compile else "pytorch_eager")
    print(json.dumps({"name": name, "torch": torch.__version__, "threads": a.threads,
                      "blas": re.search(r"BLAS_INFO=(\w+)", torch.__config__.show()).group(1),
                      "warmup_s": warmup_s, "step_s": dt, "tokens_per_s": a.batch * a.seq / dt,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main()
