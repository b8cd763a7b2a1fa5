#!/usr/bin/env python3
"""Decode-sized weight-only GEMMs: ours against PyTorch's own kernels, and the bytes-read floor.

At M = 1 to 16 for the 8B shape's projections: bf16 cuBLAS; our w8a16 and w4a16 (kernels/quant_gemm.py);
PyTorch's tinygemm int4 (`aten._weight_int4pack_mm`, group 128) and int8 (`aten._weight_int8pack_mm`)
where this build has them on CUDA. Each checked against the dequantized weights, timed as the median of
30 replays of a CUDA graph of 20 calls, and divided by the floor = weight bytes / copy bandwidth. One table, one JSON.

Usage: PYTHONPATH=server python scripts/lab/bench_wo_library.py --out wo.json
"""

# ruff: noqa: B023 - each loop's lambdas run within that iteration
from __future__ import annotations

import argparse
import json

import torch
from bench_quant_gemm import copy_bandwidth, time_graph  # the same timing as the GEMM benchmark

from llmserve.kernels.quant_gemm import w4a16_linear, w8a16_linear
from llmserve.layers.quant import formats

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # K, N


def tinygemm(W: torch.Tensor, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor):
    """Our canonical w4 (q [K/8, N] packed, scales, integer zeros) as tinygemm's operands:
    w = (q - z) s = (q - 8) s + (8 - z) s, so its float zero is (8 - z) s."""
    N, K = W.shape
    qi = formats.unpack_int4_k(q).t().contiguous().to(torch.int32)  # [N, K] in 0..15
    packed_u8 = (qi[:, ::2] << 4 | qi[:, 1::2]).to(torch.uint8)  # [N, K/2], even k in the high nibble
    wp = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
    sz = torch.stack([s.float(), ((8 - z.float()) * s.float())], dim=-1).to(torch.bfloat16).contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm(x, wp, 128, sz)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="wo.json")
    a = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    R = {"device": torch.cuda.get_device_name(), "copy_tb_s": bw / 1e12, "rows": {}}
    for name, (K, N) in SHAPES.items():
        W = torch.randn(N, K, device="cuda") / K**0.5
        q8, s8 = formats.quantize_w8(W)
        q4, s4, z4 = formats.quantize_w4(W, 128)
        d8 = formats.dequantize_w8(q8, s8).to(torch.bfloat16)
        d4 = formats.dequantize_w4(q4, s4, z4, 128).to(torch.bfloat16)
        Wb = W.to(torch.bfloat16)
        for M in (1, 2, 4, 8, 16):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            row = {}
            cands = {
                "bf16_cublas": (lambda: x @ Wb.t(), x.float() @ Wb.float().t(), N * K * 2),
                "ours_w8": (lambda: w8a16_linear(x, q8, s8, None, torch.bfloat16), x.float() @ d8.float().t(), N * K),
                "ours_w4": (lambda: w4a16_linear(x, q4, s4, z4, 128, None, torch.bfloat16), x.float() @ d4.float().t(),
                            N * K // 2),
            }  # fmt: skip
            try:
                tg = tinygemm(W, q4, s4, z4)
                cands["torch_tinygemm_w4"] = (lambda: tg(x), x.float() @ d4.float().t(), N * K // 2)
            except Exception as e:  # noqa: BLE001 - a build without it: a row that says so
                row["torch_tinygemm_w4"] = repr(e)[:200]
            try:
                s8b = s8.to(torch.bfloat16)
                torch.ops.aten._weight_int8pack_mm(x, q8, s8b)
                cands["torch_int8pack"] = (lambda: torch.ops.aten._weight_int8pack_mm(x, q8, s8b), x.float() @ d8.float().t(),
                                           N * K)  # fmt: skip
            except Exception as e:  # noqa: BLE001
                row["torch_int8pack"] = repr(e)[:200]
            for c, (fn, ref, nbytes) in cands.items():
                out = fn().float()
                err = ((out - ref).norm() / ref.norm()).item()
                us = time_graph(lambda i, fn=fn: fn(), 1)
                row[c] = dict(us=us, floor_us=nbytes / bw * 1e6, vs_floor=us / (nbytes / bw * 1e6), rel_err=err)
            R["rows"][f"{name} M={M}"] = row
            print(
                name, M, json.dumps({k: (v if isinstance(v, str) else round(v["vs_floor"], 2)) for k, v in row.items()})
            )
    json.dump(R, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
