#!/usr/bin/env python3
"""FP8 linear layers (kernels/fp8_gemm.py) against bf16 torch.mm on Llama-3-8B's linear shapes (a GPU).

For each (N, K) and M in (1, 64, 2048): bf16 torch.mm into bf16, and fp8_linear into fp32 (as the model asks)
with per-channel and 128 x 128 block scales; times in us per call over CUDA-graph replays of 50 back-to-back
calls (no launch overhead), ratio = bf16 time / fp8 time. Last, which (device, output dtype) pairs take
torch._scaled_mm for the per-channel GEMM.

Usage: PYTHONPATH=server python scripts/lab/bench_fp8_gemm.py
"""

from __future__ import annotations

import sys

import torch

from llmserve.kernels.fp8_gemm import _SCALED_MM_OK, fp8_linear, fp8_path
from llmserve.kernels.fp8_quant import FP8_MAX, _cdiv


def bench(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    g = torch.cuda.CUDAGraph()  # graph-replayed, as the runner does: no launch overhead in the figure
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: fp8 path {fp8_path(dev)}, fp32 output (as the model asks); bf16 mm")
    print("into bf16; times in us per call (CUDA-graph replays), ratio = bf16 time / fp8 time")
    print(f"{'N':>6} {'K':>6} {'M':>5} {'bf16':>8} {'fp8 ch':>8} {'ratio':>6} {'fp8 blk':>8} {'ratio':>6}")
    for N, K in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        w = torch.randn(N, K, device=dev, generator=gen, dtype=torch.bfloat16) / K**0.5
        wq = (w.float() / (w.float().abs().amax(1, keepdim=True) / FP8_MAX)).to(torch.float8_e4m3fn)
        s_ch = w.float().abs().amax(1) / FP8_MAX
        s_blk = torch.rand(_cdiv(N, 128), _cdiv(K, 128), device=dev, generator=gen) / FP8_MAX
        for M in (1, 64, 2048):
            x = torch.randn(M, K, device=dev, generator=gen, dtype=torch.bfloat16)
            t_mm = bench(lambda x=x, w=w: torch.mm(x, w.t()))
            t_ch = bench(lambda x=x, wq=wq, s=s_ch: fp8_linear(x, wq, s, None, None, torch.float32))
            t_bk = bench(lambda x=x, wq=wq, s=s_blk: fp8_linear(x, wq, s, 128, None, torch.float32))
            print(f"{N:>6} {K:>6} {M:>5} {t_mm:8.1f} {t_ch:8.1f} {t_mm / t_ch:6.2f} {t_bk:8.1f} {t_mm / t_bk:6.2f}")
    print("per channel through torch._scaled_mm (device, out dtype):", _SCALED_MM_OK)


if __name__ == "__main__":
    main()
