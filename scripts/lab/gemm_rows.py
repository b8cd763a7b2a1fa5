#!/usr/bin/env python3
"""How a decode step's matrix products cost with M rows (1 = plain decode, k + 1 = verification of
k drafts at batch 1), on the 8B shape's weights, as the torch runner calls them (bf16 weights,
fp32 output): one Llama-3-8B layer's four products x 32 + the LM head, timed over CUDA-graph
replays. Prints the step's product time per M and its ratio to M = 1.

Usage: python scripts/lab/gemm_rows.py [--rows 1,2,...] [--out gemm_rows.json]
"""

from __future__ import annotations

import argparse
import json

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS, VOCAB = 32, 128256


def time_graph(fn, reps: int = 50) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps * 1e3  # microseconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,12,16")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    w = {k: torch.randn(n, kdim, device=dev, dtype=torch.bfloat16) * 0.02 for k, (n, kdim) in SHAPES.items()}
    w["lm_head"] = torch.randn(VOCAB, 4096, device=dev, dtype=torch.bfloat16) * 0.02
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    base = None
    for m in [int(x) for x in args.rows.split(",")]:
        per = {}
        for k, wt in w.items():
            a = torch.randn(m, wt.shape[1], device=dev, dtype=torch.bfloat16)
            per[k] = time_graph(lambda a=a, wt=wt: torch.mm(a, wt.t(), out_dtype=torch.float32))
        step = LAYERS * sum(per[k] for k in SHAPES) + per["lm_head"]
        base = base or step
        out["rows"][m] = dict(per, step_us=step, vs_m1=step / base)
        print(
            f"M={m:3d}  step products {step / 1e3:7.3f} ms  x{step / base:5.3f}  "
            + "  ".join(f"{k} {v:6.1f}" for k, v in per.items()),
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
