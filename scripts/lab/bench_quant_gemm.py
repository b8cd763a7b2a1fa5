#!/usr/bin/env python3
"""Weight-only quantized GEMMs (kernels/quant_gemm.py) against bf16 cuBLAS on Llama-3-8B's linear shapes.

For each (N, K) and M: the median time of bf16 torch.mm, w8a16_linear and w4a16_linear, all writing fp32
as the torch runner calls them on CUDA (model.py: `wide`); each one's ratio to bf16 and to its memory floor
(its weight bytes over the copy bandwidth of a 1 GiB device-to-device copy measured in the same run, counted
as bytes read + written per second). Timing: CUDA graphs of >= 20 back-to-back calls (no launch overhead),
CUDA events around each replay, median over the replays. The calls cycle through enough copies of the
weights (>= 256 MiB) that they come from HBM, not from the 50 MB L2, as one layer after another would. Each
kernel's output is checked once per shape against its fp32 reference (max error / max |reference|).

Usage: PYTHONPATH=server python scripts/lab/bench_quant_gemm.py --out /tmp/quant_gemm.json [--rows 1,16,64,256,2048]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton

from llmserve.kernels.quant_gemm import w4a16_linear, w4a16_linear_ref, w8a16_linear, w8a16_linear_ref

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
G, CALLS, REPLAYS, RING = 128, 20, 25, 256 << 20


def time_graph(fn, copies: int) -> float:
    """Median microseconds per call of fn(i) (i: which weight copy) over CUDA graph replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up off the capture: compiles kernels, picks cuBLAS algorithms
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    calls = max(CALLS, copies)  # every copy once per replay
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i % copies)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes moved (read + written) per second by a 1 GiB device-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_graph(lambda i: dst.copy_(src), 1)
    return 2 * src.numel() / (us * 1e-6)


def make_weights(N: int, K: int) -> dict:
    """One copy of each format's tensors (random: only the bytes read matter for time) and its byte count."""
    dev = "cuda"
    w8 = {"qweight": torch.randint(-127, 128, (N, K), dtype=torch.int8, device=dev)}
    w8["scale"] = torch.rand(N, device=dev) * 0.01
    w4 = {"qweight": torch.randint(-(2**31), 2**31 - 1, (K // 8, N), dtype=torch.int32, device=dev)}
    w4["scales"] = (torch.rand(K // G, N, device=dev) * 0.01).to(torch.bfloat16)
    w4["zeros"] = torch.randint(0, 16, (K // G, N), device=dev).float()
    bf16 = {"weight": torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02}
    return {name: (w, sum(t.numel() * t.element_size() for t in w.values())) for name, w in
            (("bf16", bf16), ("w8a16", w8), ("w4a16", w4))}  # fmt: skip


def run_op(name: str, x: torch.Tensor, w: dict) -> torch.Tensor:
    if name == "bf16":
        return torch.mm(x, w["weight"].t(), out_dtype=torch.float32)
    if name == "w8a16":
        return w8a16_linear(x, w["qweight"], w["scale"], None, torch.float32)
    return w4a16_linear(x, w["qweight"], w["scales"], w["zeros"], G, None, torch.float32)


def reference(name: str, x: torch.Tensor, w: dict) -> torch.Tensor:
    if name == "bf16":
        return x.float() @ w["weight"].float().t()
    if name == "w8a16":
        return w8a16_linear_ref(x, w["qweight"], w["scale"], None, torch.float32)
    return w4a16_linear_ref(x, w["qweight"], w["scales"], w["zeros"], G, None, torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64,256,2048")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references
    bw = copy_bandwidth()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "copy_bandwidth_GBps": bw / 1e9, "timing": f"CUDA graphs of >= {CALLS} calls, median of {REPLAYS} "
           "replays; weights cycled over >= 256 MiB of copies", "out_dtype": "float32", "group_size": G,
           "results": []}  # fmt: skip
    print(f"{res['device']}: copy bandwidth {bw / 1e9:.0f} GB/s (read + write); {res['timing']}")
    print(f"{'shape':8} {'M':>5} | {'bf16 us':>8} {'floor':>5} | {'w8 us':>8} {'vs bf16':>7} {'floor':>5} {'err':>7} "
          f"| {'w4 us':>8} {'vs bf16':>7} {'floor':>5} {'err':>7}")  # fmt: skip
    for shape in args.shapes.split(","):
        N, K = SHAPES[shape]
        first = make_weights(N, K)
        rings = {}
        for name, (w, nbytes) in first.items():
            copies = max(2, -(-RING // nbytes))
            rings[name] = [w] + [{k: t.clone() for k, t in w.items()} for _ in range(copies - 1)]
        for M in [int(m) for m in args.rows.split(",")]:
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            row = {"shape": shape, "N": N, "K": K, "M": M}
            for name, ring in rings.items():
                us = time_graph(lambda i, ring=ring, name=name, x=x: run_op(name, x, ring[i]), len(ring))
                floor = first[name][1] / bw * 1e6
                y, ref = run_op(name, x, ring[0]), reference(name, x, ring[0])
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                row[name] = {"us": us, "floor_us": floor, "vs_floor": us / floor, "max_rel_err": err}
            for name in ("w8a16", "w4a16"):
                row[name]["vs_bf16"] = row[name]["us"] / row["bf16"]["us"]
            res["results"].append(row)
            b, q8, q4 = row["bf16"], row["w8a16"], row["w4a16"]
            print(f"{shape:8} {M:5d} | {b['us']:8.1f} {b['vs_floor']:5.2f} | {q8['us']:8.1f} {q8['vs_bf16']:7.2f} "
                  f"{q8['vs_floor']:5.2f} {q8['max_rel_err']:7.1e} | {q4['us']:8.1f} {q4['vs_bf16']:7.2f} "
                  f"{q4['vs_floor']:5.2f} {q4['max_rel_err']:7.1e}", flush=True)  # fmt: skip
        del first, rings
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", args.out)


if __name__ == "__main__":
    main()
