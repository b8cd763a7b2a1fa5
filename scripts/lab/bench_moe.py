#!/usr/bin/env python3
"""The fused routed experts (kernels/fused_moe.py) on one DeepSeek-V3 MoE layer against cuBLAS per expert (a GPU).

DeepSeek-V3's routed experts: hidden 7168, 256 experts, top-8, moe_intermediate 2048; random weights made on the
GPU, bf16 (22.5 GB) then E4M3 with 128 x 128 block scales (11 GB; the bf16 ones freed first); uniform random
top-8 routing at each token count. Per (format, tokens):
  fused: fused_moe's time (median of >= 20 CUDA-event-timed calls after warm-up);
  base: the baseline in the same run, expert by expert as layers/moe.py's loop does it (sort, counts to the host,
    per chosen expert: gather, gate_up matmul, SwiGLU, down matmul, weighted index_add): bf16 torch.matmul
    (cuBLAS); for FP8 torch._scaled_mm with block scales (activations quantized per 1 x 128) where a probe finds
    it working, else the bf16 baseline's figure is the FP8 baseline (said in the table);
  floor: the distinct chosen experts' weight bytes (+ scales) + x in + the fp32 sum out, and its time at the
    device-to-device copy bandwidth measured in this run (1 GiB copied, bytes read + written);
  TFLOP/s and % of dense peak: 2 * pairs * 3 * hidden * I (989 TFLOP/s bf16, 1979 FP8: H100/H200 SXM);
  err: max|fused - base| / max|base|.

Usage: PYTHONPATH=server python scripts/lab/bench_moe.py --out moe.json
       PYTHONPATH=server python scripts/lab/bench_moe.py --interpret-smoke   (CPU, TRITON_INTERPRET=1, tiny)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

PEAK = {"bf16": 989e12, "fp8": 1979e12}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--tokens", default="1,16,64,256,1024")
    p.add_argument("--formats", default="bf16,fp8")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--interpret-smoke", action="store_true", help="the same code at a tiny size on the CPU")
    return p.parse_args()


ARGS = parse()
if ARGS.interpret_smoke:  # triton reads it at import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from llmserve.kernels.fp8_quant import quantize_act_ref  # noqa: E402
from llmserve.kernels.fused_moe import fused_moe  # noqa: E402

DEV = "cpu" if ARGS.interpret_smoke else "cuda"


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn, iters: int) -> float:
    """Median seconds per call after warm-up (CUDA events; the host clock under the interpreter)."""
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(iters):
        if DEV == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy (read + written), 1 GiB (1 MiB under the interpreter)."""
    n = (1 << 30) if DEV == "cuda" else (1 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return 2 * n / timed(lambda: dst.copy_(src), 10)


def make_weights(fmt: str, E: int, H: int, inter: int) -> dict:
    """Stacked random weights: w1 [E, 2I, H], w2 [E, H, I] (+ block scales for FP8), made chunk by chunk."""
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    out = {}
    for name, (N, K) in (("w1", (2 * inter, H)), ("w2", (H, inter))):
        w = torch.empty(E, N, K, dtype=dt if fmt == "bf16" else torch.float8_e4m3fn, device=DEV)
        for e0 in range(0, E, 16):
            w[e0 : e0 + 16] = (
                torch.randn(min(16, E - e0), N, K, dtype=dt, device=DEV) * (4.0 if fmt == "fp8" else K**-0.5)
            ).to(w.dtype)
        out[name] = w
        if fmt == "fp8":
            out["s" + name[1]] = torch.rand(E, N // 128, K // 128, device=DEV) * 1e-2 / K**0.5 + 1e-4
    return out


def dequant(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)


def scaled_mm_block(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 @ (w * s).T by torch._scaled_mm with 1 x 128 activation and 128 x 128 weight scales."""
    xq, xs = quantize_act_ref(x, 128)
    M = x.shape[0]
    pad = (-M) % 4  # the blockwise scales' rows: cuBLASLt wants them 16-byte aligned
    if pad:
        xq = torch.cat([xq, xq.new_zeros(pad, xq.shape[1])])
        xs = torch.cat([xs, xs.new_ones(pad, xs.shape[1])])
    y = torch._scaled_mm(xq, w.t(), scale_a=xs.t().contiguous().t(), scale_b=s.t(), out_dtype=torch.bfloat16)
    return y[:M]


def scaled_mm_works() -> bool:
    """Whether this torch runs block-scaled _scaled_mm here, and right (against the dequantized product)."""
    if DEV != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    try:
        x = torch.randn(5, 256, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(384, 256, device=DEV).to(torch.float8_e4m3fn)
        s = torch.rand(3, 2, device=DEV) + 0.5
        ref = x.float() @ dequant(w, s).t()
        y = scaled_mm_block(x, w, s).float()
        return bool((y - ref).abs().max() <= 0.05 * ref.abs().max())
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
        print(f"torch._scaled_mm with block scales: not here ({str(e).splitlines()[0][:120]})")
        return False


def per_expert(x, weights, ids, W: dict, mm) -> torch.Tensor:
    """The loop's baseline: expert by expert over the tokens that chose it (host sync for the counts)."""
    k = ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=W["w1"].shape[0]).tolist()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        tokens = pairs // k
        gu = mm(x[tokens], W, "1", e)
        g, u = gu.float().chunk(2, dim=-1)
        y = mm((F.silu(g) * u).to(x.dtype), W, "2", e).float() * weights.flatten()[pairs, None]
        out.index_add_(0, tokens, y)
        start += n
    return out


def mm_dense(a, W, i, e):
    return a @ W["w" + i][e].t()


def mm_dequant(a, W, i, e):  # the FP8 weights' exact values (the error's reference, not timed)
    return a @ dequant(W["w" + i][e], W["s" + i][e]).to(a.dtype).t()


def mm_scaled(a, W, i, e):
    return scaled_mm_block(a, W["w" + i][e], W["s" + i][e])


def run_format(fmt: str, dims: tuple[int, int, int, int], tokens: list[int], bw: float, base_bf16: dict) -> list[dict]:
    E, k, H, inter = dims
    W = make_weights(fmt, E, H, inter)
    per_w = sum(t[0].numel() * t.element_size() for t in W.values())  # one expert's bytes (scales included)
    mm, base_name = mm_dense, "cuBLAS bf16"
    if fmt == "fp8":
        mm, base_name = (mm_scaled, "_scaled_mm block") if scaled_mm_works() else (None, "bf16 figure")
    dt = W["w1"].dtype if fmt == "bf16" else (torch.bfloat16 if DEV == "cuda" else torch.float32)
    rows = []
    for T in tokens:
        g = torch.Generator(device=DEV).manual_seed(T)
        x = torch.randn(T, H, device=DEV, generator=g).to(dt)
        ids = torch.rand(T, E, device=DEV, generator=g).topk(k, dim=-1).indices
        weights = torch.rand(T, k, device=DEV, generator=g)
        args = (x, weights, ids, W["w1"], W["w2"], W.get("s1"), W.get("s2"))
        t_fused = timed(lambda a=args: fused_moe(*a), ARGS.iters)
        y = fused_moe(*args)
        if mm is not None:
            t_base = timed(lambda a=(x, weights, ids, W, mm): per_expert(*a), ARGS.iters)
        else:
            t_base = base_bf16.get(T, float("nan"))
        ref = per_expert(x, weights, ids, W, mm_dense if fmt == "bf16" else mm_dequant)
        err = float((y - ref).abs().max() / ref.abs().max())
        n_exp = int(torch.unique(ids).numel())
        floor_bytes = n_exp * per_w + x.numel() * x.element_size() + T * H * 4
        flops = 2 * T * k * 3 * H * inter
        rows.append(
            dict(
                format=fmt,
                tokens=T,
                experts_read=n_exp,
                fused_us=t_fused * 1e6,
                base_us=t_base * 1e6,
                baseline=base_name,
                speedup=t_base / t_fused,
                floor_bytes=floor_bytes,
                floor_us=floor_bytes / bw * 1e6,
                of_floor=floor_bytes / bw / t_fused,
                tflops=flops / t_fused / 1e12,
                of_peak=flops / t_fused / PEAK[fmt],
                err=err,
            )
        )
        print_row(rows[-1])
        if fmt == "bf16":
            base_bf16[T] = t_base
    W.clear()  # the next format's weights need the memory
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return rows


def print_row(r: dict) -> None:
    print(
        f"{r['format']:>5} {r['tokens']:>6} {r['experts_read']:>4} {r['fused_us']:>10.1f} {r['base_us']:>10.1f} "
        f"{r['speedup']:>6.2f} {r['floor_us']:>9.1f} {100 * r['of_floor']:>6.1f}% {r['tflops']:>7.1f} "
        f"{100 * r['of_peak']:>6.2f}% {r['err']:>8.1e}  {r['baseline']}"
    )


def main() -> None:
    if DEV == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --interpret-smoke)")
    dims = (16, 4, 256, 128) if ARGS.interpret_smoke else (256, 8, 7168, 2048)  # E, top-k, hidden, I
    tokens = [1, 5] if ARGS.interpret_smoke else [int(t) for t in ARGS.tokens.split(",")]
    if ARGS.interpret_smoke:
        ARGS.iters = 2
    name = torch.cuda.get_device_name() if DEV == "cuda" else "CPU (TRITON_INTERPRET=1)"
    t0 = time.perf_counter()
    bw = copy_bandwidth()
    print(f"{name}; E, k, hidden, I = {dims}; copy bandwidth {bw / 1e9:.0f} GB/s (read + written)")
    print(
        f"{'fmt':>5} {'tokens':>6} {'exp':>4} {'fused us':>10} {'base us':>10} {'x':>6} {'floor us':>9} "
        f"{'floor':>7} {'TFLOP/s':>7} {'peak':>7} {'err':>8}  baseline"
    )
    rows: list[dict] = []
    base_bf16: dict[int, float] = {}
    for fmt in ARGS.formats.split(","):
        rows += run_format(fmt, dims, tokens, bw, base_bf16)
    print(f"total {time.perf_counter() - t0:.1f} s")
    if ARGS.out:
        meta = dict(device=name, dims=dict(zip(("experts", "top_k", "hidden", "intermediate"), dims)), copy_bw=bw)
        with open(ARGS.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
