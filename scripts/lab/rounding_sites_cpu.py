#!/usr/bin/env python3
"""Which roundings of a bf16 forward make its logit error? A CPU emulation on the 8B layer shape.

An fp32 Llama layer stack (hidden 4096, 32/8 heads, intermediate 14336; fan-in random weights
rounded to bf16, as random_model.py writes them; fewer layers and a smaller vocabulary than the
8B model, which the error barely depends on) is run exactly, then with bf16 (or fp16) rounding at
chosen sites. Prints the worst and mean per-row relative L2 error of the logits against the exact
forward. This chose what the torch runner keeps wide (docs/gpu.md). The error hardly grows with
depth: at 8 layers, a plain bf16 forward with an fp32 residual is 1.02e-2 off (worst row) and ours
7.6e-3, where the H200 measured 1.12e-2 and 8.2e-3 at 32 layers; so it is set by how many roundings
each layer makes, and by where.

    PYTHONPATH=server python scripts/lab/rounding_sites_cpu.py [--layers 8] [--tokens 128]   # ~1 min, 12 GB
"""

from __future__ import annotations

import argparse
import math

import torch

HIDDEN, INTER, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32000, 32, 8, 128

# site -> how a value is rounded there; absent sites stay fp32
PLAIN = dict(norm_out="bf16", qkv_out="bf16", q="bf16", kv="bf16", p="bf16", attn_out="bf16",
             gate_up_out="bf16", swiglu_out="bf16", final_out="bf16")  # fmt: skip
OURS = dict(norm_out="bf16", kv="fp16", q="fp16", p="fp16", attn_out="bf16", swiglu_out="bf16", final_out="bf16")


def rounder(dtype: str | None):
    if dtype is None:
        return lambda x: x
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    return lambda x: x.to(dt).float()


def build(layers: int, tokens: int):
    torch.manual_seed(0)

    def w(o: int, i: int) -> torch.Tensor:
        return (torch.randn(o, i) * i**-0.5).bfloat16().float()

    kv = KV_HEADS * HEAD_DIM
    weights = dict(
        embed=(torch.randn(VOCAB, HIDDEN) * 0.02).bfloat16().float(),
        lm_head=w(VOCAB, HIDDEN),
        layers=[
            dict(
                qkv=torch.cat([w(HIDDEN, HIDDEN), w(kv, HIDDEN), w(kv, HIDDEN)]),
                o=w(HIDDEN, HIDDEN),
                gate_up=torch.cat([w(INTER, HIDDEN), w(INTER, HIDDEN)]),
                down=w(HIDDEN, INTER),
            )  # fmt: skip
            for _ in range(layers)
        ],
    )
    inv = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    ang = torch.arange(tokens, dtype=torch.float64)[:, None] * inv[None]
    return weights, ang.cos().float(), ang.sin().float(), torch.randint(0, VOCAB, (tokens,))


def forward(weights, cos, sin, ids, sites: dict[str, str]) -> torch.Tensor:
    r = {k: rounder(sites.get(k)) for k in PLAIN}
    T = ids.shape[0]
    half = HEAD_DIM // 2

    def rope(x):
        a, b = x[..., :half], x[..., half:]
        c, s = cos[:, None], sin[:, None]
        return torch.cat([a * c - b * s, b * c + a * s], -1)

    def norm(x):
        return r["norm_out"](x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

    h = weights["embed"][ids].clone()  # the residual stream: fp32 throughout
    causal = torch.ones(T, T).tril().bool()
    for lw in weights["layers"]:
        qkv = r["qkv_out"](norm(h) @ lw["qkv"].t())
        q = r["q"](rope(qkv[:, :HIDDEN].view(T, HEADS, HEAD_DIM)))
        k = r["kv"](rope(qkv[:, HIDDEN : HIDDEN + KV_HEADS * HEAD_DIM].view(T, KV_HEADS, HEAD_DIM)))
        v = r["kv"](qkv[:, HIDDEN + KV_HEADS * HEAD_DIM :].view(T, KV_HEADS, HEAD_DIM))
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, 1) for t in (k, v))
        s = torch.einsum("thd,khd->htk", q, k) / math.sqrt(HEAD_DIM)
        s = s.masked_fill(~causal, float("-inf"))
        p = (s - s.amax(-1, keepdim=True)).exp()
        denom = p.sum(-1, keepdim=True).transpose(0, 1)
        a = torch.einsum("htk,khd->thd", r["p"](p), v) / denom
        h = h + r["attn_out"](a.reshape(T, HIDDEN)) @ lw["o"].t()
        gu = r["gate_up_out"](norm(h) @ lw["gate_up"].t())
        y = torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:]
        h = h + r["swiglu_out"](y) @ lw["down"].t()
    return r["final_out"](h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)) @ weights["lm_head"].t()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    weights, cos, sin, ids = build(args.layers, args.tokens)
    exact = forward(weights, cos, sin, ids, {})
    cases = {"plain bf16 (fp32 residual)": PLAIN}
    for site in PLAIN:
        cases[f"plain, {site} kept fp32"] = {k: v for k, v in PLAIN.items() if k != site}
    cases["ours: qkv/gate_up fp32, q/k/v/p fp16"] = OURS
    cases["ours, gate_up rounded to bf16"] = {**OURS, "gate_up_out": "bf16"}
    cases["only the GEMM inputs after norms"] = {"norm_out": "bf16"}
    for name, sites in cases.items():
        got = forward(weights, cos, sin, ids, sites)
        err = (got - exact).norm(dim=-1) / exact.norm(dim=-1)
        print(f"{name:40s} worst {err.max():.3e}  mean {err.mean():.3e}", flush=True)


if __name__ == "__main__":
    main()
