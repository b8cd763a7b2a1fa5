#!/usr/bin/env python3
"""Launch shapes of the w8a16 GEMM at decode sizes (kernels/quant_gemm.py), swept on the 8B linear shapes.

For M in --rows and each (N, K) of bench_quant_gemm.SHAPES: the kernel's current plan (`_plan_w8`) and
every combination of BLOCK_N, BLOCK_K, warps, stages and K slices (programs = waves x SMs), timed as
bench_quant_gemm times them (CUDA graphs, weights cycled through HBM), each checked against the fp32
reference. Prints the plan's time, the best five, and each one's fraction of the memory floor.

Rows above SMALL_M (64) sweep the large-M plan's tiles instead (BLOCK_M x BLOCK_N x BLOCK_K, warps, stages;
one pass over K), beside bf16 cuBLAS at the same M.

Usage: PYTHONPATH=server python scripts/lab/sweep_w8_decode.py --out sweep.json [--rows 1,4,16]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from bench_quant_gemm import SHAPES, copy_bandwidth, make_weights, time_graph

from llmserve.kernels import quant_gemm as Q


def launch(x, w, meta: dict, split: int, per_split: int, out: torch.Tensor) -> torch.Tensor:
    M, K = x.shape
    N = w["qweight"].shape[0]
    out.zero_()
    grid = (Q._cdiv(M, meta["BLOCK_M"]) * Q._cdiv(N, meta["BLOCK_N"]), split)
    Q._w8a16_kernel[grid](
        x, w["qweight"], w["scale"], w["scale"], out, M, N, K, x.stride(0), x.stride(1),
        w["qweight"].stride(0), w["qweight"].stride(1), out.stride(0), per_split,
        HAS_BIAS=False, PREC="tf32", **meta,
    )  # fmt: skip
    return out


def measure(c: dict, meta: dict, split: int, per: int, label: str) -> dict:
    x, w8, out = c["x"], c["w8"], c["out"]
    try:
        got = launch(x, w8[0], meta, split, per, out).clone()
        err = ((got - c["ref"]).abs().max() / c["ref"].abs().max()).item()
        us = time_graph(lambda i: launch(x, w8[i], meta, split, per, out), c["copies"])
    except Exception as e:  # noqa: BLE001 - a shape that does not compile or fit
        return dict(label=label, error=repr(e)[:160])
    cfg = {k: meta[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")}
    return dict(label=label, **cfg, split=split, us=us, vs_floor=us / c["floor_us"], err=err)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep.json")
    ap.add_argument("--rows", default="1,4,16")
    a = ap.parse_args()
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res: dict = {"device": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "sms": sms, "cases": []}
    for (name, (N, K)), M in itertools.product(SHAPES.items(), [int(r) for r in a.rows.split(",")]):
        copies = max(1, (256 << 20) // (N * K))
        ws = [make_weights(N, K) for _ in range(copies)]
        w8 = [w["w8a16"][0] for w in ws]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        ref = Q.w8a16_linear_ref(x, w8[0]["qweight"], w8[0]["scale"], out_dtype=torch.float32)
        out = torch.zeros(M, N, device="cuda", dtype=torch.float32)
        floor_us = N * K / bw * 1e6  # as bench_quant_gemm: the weight's bytes over the copy bandwidth
        plan, split0, per0 = Q._plan_w8(M, N, K, sms)
        rows = []

        c = dict(x=x, w8=w8, out=out, ref=ref, copies=copies, floor_us=floor_us)
        base = measure(c, plan, split0, per0, "plan")
        wb = [w["bf16"][0]["weight"] for w in ws]
        bf16_us = time_graph(lambda i, x=x, wb=wb: torch.mm(x, wb[i].t(), out_dtype=torch.float32), copies)
        bm = plan["BLOCK_M"]
        if M > Q.SMALL_M:  # one pass over K per tile (no split): the tile shapes of the large-M plan
            for bm, bn, bk, warps, stages in itertools.product(
                [64, 128, 256], [64, 128, 256], [64, 128], [4, 8], [2, 3, 4]
            ):
                meta = dict(plan, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
                meta.update(EVEN_K=K % bk == 0)
                rows.append(measure(c, meta, 1, Q._cdiv(K, bk), "large"))
        for bn, bk, warps, stages in itertools.product([64, 128], [128, 256, 512], [4, 8], [2, 3, 4, 6]):
            if M > Q.SMALL_M:
                break
            iters = Q._cdiv(K, bk)
            tiles = Q._cdiv(M, bm) * Q._cdiv(N, bn)
            for waves in (1, 2, 3, 4, 6, 8):
                split = max(1, min(waves * sms // tiles, iters))
                per = Q._cdiv(iters, split)
                split = Q._cdiv(iters, per)
                meta = dict(plan, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
                meta.update(ATOMIC=split > 1, EVEN_K=K % bk == 0)
                rows.append(measure(c, meta, split, per, f"waves{waves}"))
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        dedup, seen = [], set()
        for r in ok:
            key = (r["BLOCK_M"], r["BLOCK_N"], r["BLOCK_K"], r["num_warps"], r["num_stages"], r["split"])
            if key not in seen:
                seen.add(key)
                dedup.append(r)
        case = dict(shape=name, M=M, N=N, K=K, floor_us=floor_us, bf16_us=bf16_us, plan=base, best=dedup[:5])
        res["cases"].append(case)
        print(json.dumps(dict(shape=name, M=M, bf16_us=bf16_us, plan=base, best=dedup[:3])), flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
