#!/usr/bin/env python3
"""The same MoE model, loss terms and AdamW as spes, written in PyTorch eager, timed the same
way as bench/train_bench.cpp (random tokens, full optimizer steps). Prints one JSON line.
Run with Debian's python3-torch (same kernels as libtorch-dev): /usr/bin/python3."""
import argparse, json, math, time, resource
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

    def rope(s, x):
        h = x.shape[-1] // 2
        return x * s.cos + torch.cat([-x[..., h:], x[..., :h]], -1) * s.sin

    def forward(s, tok, tgt):
        a = s.a
        B, T = tok.shape
        D, H = a.d_model, a.heads
        x = s.embed[tok]
        lb = 0.0
        rz = 0.0
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        for l in s.layers:
            h = rms_norm(x, l.attn_norm)
            q = rms_norm(h @ l.q.t(), l.q_norm).view(B, T, H, -1).transpose(1, 2)
            k = rms_norm(h @ l.k.t(), l.k_norm).view(B, T, H, -1).transpose(1, 2)
            v = (h @ l.v.t()).view(B, T, H, -1).transpose(1, 2)
            q, k = s.rope(q), s.rope(k)
            sc = (q @ k.transpose(-2, -1)) / math.sqrt(D // H)
            y = torch.softmax(sc.masked_fill(mask, float("-inf")), -1) @ v
            x = x + y.transpose(1, 2).reshape(B, T, D) @ l.o.t()
            hn = rms_norm(x, l.mlp_norm).reshape(-1, D)
            logits = (hn @ l.router.t()).float()
            p = torch.softmax(logits, -1)
            w, idx = p.topk(a.top_k, -1)
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
                xe = xs[start:start + c]
                outs.append((F.silu(xe @ l.w1[e].t()) * (xe @ l.v1[e].t())) @ l.w2[e].t())
                start += c
            ys = torch.cat(outs) * sw.unsqueeze(1)
            x = x + torch.zeros_like(hn).index_add(0, tok_of, ys).view(B, T, D)
            lb = lb + (counts.float() * p.mean(0)).sum()
            rz = rz + torch.logsumexp(logits, -1).pow(2).mean()
        hn = rms_norm(x, s.norm).reshape(-1, D)
        lg = hn @ s.head.t()
        lse = torch.logsumexp(lg, -1)
        ce = (lse - lg.gather(-1, tgt.reshape(-1, 1)).squeeze(-1)).mean()
        n = B * T
        lb = lb * a.experts / (a.layers * n * a.top_k)
        return ce + 1e-4 * lse.pow(2).mean() + 0.01 * lb + 0.001 * rz


def main():
    ap = argparse.ArgumentParser()
    for k, v in dict(d_model=512, layers=8, heads=8, experts=8, top_k=2, hidden=1024, vocab=8192,
                     seq=256, batch=8, steps=5, warmup=2, threads=2).items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    ap.add_argument("--theta", type=float, default=500000.0)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    m = Model(a)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1)

    def step():
        tok = torch.randint(a.vocab, (a.batch, a.seq))
        loss = m(tok, torch.roll(tok, -1, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(a.warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    dt = (time.perf_counter() - t0) / a.steps
    print(json.dumps({"name": "pytorch_eager", "torch": torch.__version__, "threads": a.threads,
                      "step_s": dt, "tokens_per_s": a.batch * a.seq / dt,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main()
