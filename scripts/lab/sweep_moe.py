#!/usr/bin/env python3
"""The fused MoE kernel's launch shapes (kernels/fused_moe.py `moe_config` keys) at decode sizes, against the
shape `moe_config` picks, on DeepSeek-V3's (hidden 7168, 256 experts top-8, I 2048) and V2-Lite's (2048, 64
top-6, 1408) routed experts, bf16 (GPU).

Per (shape, tokens): each config's median time (CUDA events, >= 20 calls after warm-up) and its share of the
copy bandwidth on the chosen experts' weight bytes; the best and the default.

Usage: PYTHONPATH=server python scripts/lab/sweep_moe.py [--tokens 1] [--out sweep_moe.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from functools import partial

import torch

from llmserve.kernels.fused_moe import fused_moe, moe_config

SHAPES = {"v3": (256, 8, 7168, 2048), "v2-lite": (64, 6, 2048, 1408)}


def timed(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1")
    p.add_argument("--out")
    args = p.parse_args()
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    bw = 2 * n / timed(partial(torch.empty_like(src).copy_, src), 10)
    src = None
    rows = []
    for name, (E, k, H, inter) in SHAPES.items():
        w1 = (torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16) * H**-0.5).contiguous()
        w2 = (torch.randn(E, H, inter, device="cuda", dtype=torch.bfloat16) * inter**-0.5).contiguous()
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
            wts = torch.rand(T, k, device="cuda")
            chosen = ids.unique().numel()
            floor = chosen * 3 * H * inter * 2 / bw
            default = moe_config(T * k, E)
            space = itertools.product((16,), (32, 64), (64, 128), (128, 256), (4,), (3, 5))
            results = []
            for bm, n1, n2, bk, warps, stages in space:
                cfg = dict(BLOCK_M=bm, BLOCK_N1=n1, BLOCK_N2=n2, BLOCK_K=bk, num_warps=warps, num_stages=stages)
                try:
                    s = timed(partial(fused_moe, x, wts, ids, w1, w2, None, None, cfg))
                except Exception as e:  # noqa: BLE001 - a shape that does not compile or fit: skipped
                    print(f"  {cfg}: {type(e).__name__}")
                    continue
                results.append((s, cfg))
            d = timed(partial(fused_moe, x, wts, ids, w1, w2, None, None, default))
            best_s, best = min(results, key=lambda r: r[0])
            row = dict(shape=name, tokens=T, experts=chosen, floor_us=floor * 1e6, default=default,
                       default_us=d * 1e6, best=best, best_us=best_s * 1e6, best_of_bw=floor / best_s)  # fmt: skip
            rows.append(row)
            print(f"{name:8s} T={T:5d} experts {chosen:3d} floor {floor * 1e6:7.1f} us  default {d * 1e6:7.1f} us "
                  f"({floor / d:.0%})  best {best_s * 1e6:7.1f} us ({floor / best_s:.0%}) {best}", flush=True)  # fmt: skip
        w1 = w2 = None
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(copy_bw=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
