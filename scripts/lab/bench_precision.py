#!/usr/bin/env python3
"""What each avoided bf16 rounding of the torch runner costs, on the 8B shape (one layer's pieces).

The model keeps q and the projection outputs in fp32 and a bf16 model's KV cache in fp16
(kernels/attention.py). This times, with CUDA events (median of 30), against the plain
bf16 variant in the same run:
  - paged attention, decode batch 256 (contexts U[200, 1300]) and one 1024-token prefill, over an
    fp16 cache with fp32 q (ours) and over a bf16 cache with bf16 q (a plain bf16 model), and the
    relative error of each against the exact attention of the unrounded fp32 K/V;
  - the projections written in fp32 instead of bf16 (qkv, o, gate_up, down) and SwiGLU reading fp32,
    at 256, 1024 and 2048 tokens.

Usage: PYTHONPATH=server python scripts/lab/bench_precision.py --out precision.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import torch
import torch.nn.functional as F

from llmserve.kernels.activation import swiglu
from llmserve.kernels.attention import AttnMeta, paged_attention, paged_attention_ref, tile_tokens
from llmserve.runners.torch.inputs import work_items

H, KVH, D, HIDDEN, INTER, BS = 32, 8, 128, 4096, 14336, 64


def timed(fn, *args, n: int = 30) -> float:
    """Median ms of fn(*args) over n runs after 3 warm-ups."""
    for _ in range(3):
        fn(*args)
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(*args)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def attention_case(q_lens: np.ndarray, seq_lens: np.ndarray, rng: np.random.Generator):
    decode_only = bool((q_lens == 1).all())
    nblk = -(-seq_lens // BS)
    total = int(nblk.sum())
    k = torch.randn(total, KVH, BS, D, device="cuda")
    v = torch.randn_like(k)
    perm = rng.permutation(total)
    bt = np.zeros((len(q_lens), int(nblk.max())), dtype=np.int64)
    off = 0
    for i, n in enumerate(nblk):
        bt[i, :n] = perm[off : off + n]
        off += n
    block_t = tile_tokens(H, KVH, decode_only)
    item_seq, item_q = work_items(q_lens, block_t)
    i32 = lambda a: torch.tensor(np.asarray(a), dtype=torch.int32, device="cuda")  # noqa: E731
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    meta = AttnMeta(i32(cu), i32(seq_lens), i32(bt), i32(item_seq), i32(item_q), block_t, 1)
    q = torch.randn(int(cu[-1]), H, D, device="cuda", dtype=torch.float32)
    return q, k, v, meta


def bench_attention(R: dict, rng: np.random.Generator) -> None:
    cases = {
        "decode b256": (np.ones(256, dtype=np.int64), rng.integers(200, 1300, 256)),
        "prefill 1024": (np.array([1024]), np.array([1024])),
    }
    for name, (q_lens, seq_lens) in cases.items():
        q, k, v, meta = attention_case(q_lens, seq_lens, rng)
        # the exact function of the unrounded K/V on a subset of sequences (the reference loops in Python)
        sub = slice(0, min(16, len(q_lens)))
        rows = int(meta.cu_q[sub.stop].item())
        sub_meta = AttnMeta(meta.cu_q[: sub.stop + 1], meta.seq_lens[sub], meta.block_tables[sub],
                            meta.item_seq, meta.item_qstart, meta.block_t, 1)  # fmt: skip
        exact = paged_attention_ref(q[:rows], k, v, sub_meta, D**-0.5, torch.float32)
        floor = float((exact.bfloat16().float() - exact).norm() / exact.norm())
        base = None
        for mode, qq, cache in (("bf16 cache, bf16 q", q.bfloat16(), torch.bfloat16),
                                ("fp16 cache, fp32 q", q, torch.float16)):  # fmt: skip
            kc, vc = k.to(cache), v.to(cache)
            ms = timed(paged_attention, qq, kc, vc, meta, D**-0.5, torch.bfloat16)
            out = paged_attention(qq, kc, vc, meta, D**-0.5, torch.bfloat16)[:rows].float()
            err = float((out - exact).norm() / exact.norm())
            base = base or ms
            R.setdefault("attention", []).append(
                dict(case=name, mode=mode, ms=ms, vs_bf16=ms / base, rel_err=err, output_rounding=floor)
            )
            print(f"{name:13s} {mode}  {ms:7.3f} ms  x{ms / base:5.2f}  rel. error {err:.2e} "
                  f"(output rounding alone {floor:.2e})", flush=True)  # fmt: skip


def bench_projections(R: dict) -> None:
    shapes = {"qkv": (HIDDEN, (H + 2 * KVH) * D), "o": (H * D, HIDDEN), "gate_up": (HIDDEN, 2 * INTER),
              "down": (INTER, HIDDEN)}  # fmt: skip
    for T in (256, 1024, 2048):
        for name, (k_in, n_out) in shapes.items():
            x = torch.randn(T, k_in, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n_out, k_in, device="cuda", dtype=torch.bfloat16) * k_in**-0.5
            bf = timed(F.linear, x, w)
            wide = timed(torch.mm, x, w.t(), torch.float32)
            R.setdefault("projections", []).append(dict(tokens=T, proj=name, bf16_ms=bf, fp32_out_ms=wide))
            print(f"T={T:5d} {name:8s} bf16 out {bf:7.3f} ms  fp32 out {wide:7.3f} ms  x{wide / bf:5.2f}", flush=True)
        g16 = torch.randn(T, 2 * INTER, device="cuda", dtype=torch.bfloat16)
        g32 = g16.float()
        a, b = timed(swiglu, g16), timed(swiglu, g32, torch.bfloat16)
        R.setdefault("swiglu", []).append(dict(tokens=T, bf16_in_ms=a, fp32_in_ms=b))
        print(f"T={T:5d} swiglu   bf16 in  {a:7.3f} ms  fp32 in  {b:7.3f} ms  x{b / a:5.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="precision.json")
    args = ap.parse_args()
    R: dict = {"device": torch.cuda.get_device_name()}
    torch.manual_seed(0)
    bench_attention(R, np.random.default_rng(0))
    bench_projections(R)
    with open(args.out, "w") as f:
        json.dump(R, f, indent=1)


if __name__ == "__main__":
    main()
