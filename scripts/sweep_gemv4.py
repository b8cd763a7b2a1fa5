#!/usr/bin/env python3
"""The batch-1 GEMV over 4-bit weights (kernels/gemv4.py) against PyTorch's tinygemm and our w4a16 kernel (issue 15; GPU).

For each projection of the 8B shape (whole, and one rank's share at MP_NUM=2), one bf16 row of x, random
weights quantized to canonical w4 (group 128): tinygemm (`aten._weight_int4pack_mm`, what int4 layers ran at
M <= 4), `w4a16_linear` at M = 1, the floor (gemv4's bytes: 4-bit weights and 4 bytes a group, at this run's
copy bandwidth), and gemv4 over a set of launches (rows a program, groups a tile, warps, x's load), each checked
against the fp32 reference first. CUDA-graph replays over enough weight copies to miss L2.

    PYTHONPATH=server:scripts python scripts/sweep_gemv4.py --out gemv4_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from llmserve.runners.torch.kernels.gemv4 import gemv4, gemv4_operands, gemv4_ref
from llmserve.runners.torch.quant import formats
from llmserve.runners.torch.quant.methods import tinygemm_operands

LAUNCHES = list(itertools.product((16, 32), (8, 16), (4, 8), (1,), (0, 1)))  # (BLOCK_N, GPT, warps, PREFETCH, BIASED)


def shapes(mp: int) -> list[tuple[str, int, int]]:
    h, f, kvd = 4096, 14336, 1024
    return [("qkv", (h + 2 * kvd) // mp, h), ("o", h, h // mp), ("gate_up", 2 * f // mp, h), ("down", h, f // mp)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemv4_sweep.json")
    ap.add_argument("--mp", default="1,2")
    a = ap.parse_args()
    from bench_quant_gemm import copy_bandwidth, time_graph

    from llmserve.runners.torch.kernels.quant_gemm import w4a16_linear

    res: dict = {"device": torch.cuda.get_device_name(), "shapes": {}}
    res["copy_tb_s"] = bw = copy_bandwidth() / 1e12
    f32, G = torch.float32, 128
    for mp in (int(m) for m in a.mp.split(",")):
        for name, N, K in shapes(mp):
            copies = max(4, int(800e6 // (N * K)))
            x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
            canon, ops, tg = [], [], []
            for _ in range(copies):
                q, s, z = formats.quantize_w4(torch.randn(N, K, device="cuda"), G)
                canon.append((q, s, z))
                ops.append(gemv4_operands(q, s, z))
                tg.append(tinygemm_operands(q, s, z, G))
            nbytes = ops[0][0].numel() * 4 + ops[0][1].numel() * 4
            row: dict = {"floor_us": nbytes / (bw * 1e12) * 1e6}
            row["tinygemm_us"] = time_graph(
                lambda i, x=x, tg=tg: torch.ops.aten._weight_int4pack_mm(x, tg[i][0], G, tg[i][1]), copies
            )
            row["w4a16_us"] = time_graph(lambda i, x=x, c=canon: w4a16_linear(x, *c[i], G, None, f32), copies)
            want = gemv4_ref(x, *ops[0], None, f32)
            for cfg in LAUNCHES:
                key = "n{}_g{}_w{}_p{}_b{}".format(*cfg)
                try:
                    got = gemv4(x, *ops[0], None, f32, config=cfg)
                    if not torch.allclose(got, want, rtol=1e-3, atol=1e-2):
                        row[key] = f"wrong: {(got - want).abs().max().item():.3g}"
                        continue
                    row[key] = time_graph(
                        lambda i, x=x, ops=ops, cfg=cfg: gemv4(x, *ops[i], None, f32, config=cfg), copies
                    )
                except Exception as e:  # noqa: BLE001 - a launch that does not compile is reported, not fatal
                    row[key] = repr(e)[:200]
            timed = {k: v for k, v in row.items() if k.startswith("n") and isinstance(v, float)}
            row["best"] = min(timed, key=timed.get) if timed else None
            res["shapes"][f"mp{mp}:{name}"] = row
            Path(a.out).write_text(json.dumps(res, indent=1))
            b = row["best"]
            print(
                f"mp{mp} {name:8s} N={N} K={K}: floor {row['floor_us']:5.1f} us | tinygemm {row['tinygemm_us']:5.1f} | "
                f"w4a16 {row['w4a16_us']:5.1f} | gemv4 best {row.get(b, float('nan')):5.1f} ({b})",
                flush=True,
            )
            del canon, ops, tg
            torch.cuda.empty_cache()
    for mp in (int(m) for m in a.mp.split(",")):
        rows = [r for k, r in res["shapes"].items() if k.startswith(f"mp{mp}:")]
        layer = {k: sum(r[k] for r in rows) for k in ("floor_us", "tinygemm_us", "w4a16_us")}
        keys = set.intersection(
            *({k for k, v in r.items() if k.startswith("n") and isinstance(v, float)} for r in rows)
        )
        launches = {k: sum(r[k] for r in rows) for k in keys}
        layer["gemv4_best5"] = {k: launches[k] for k in sorted(launches, key=launches.get)[:5]}
        layer["gemv4_best_per_shape"] = sum(r[r["best"]] for r in rows if r["best"])
        res[f"layer_mp{mp}"] = layer
        print(f"mp{mp} per layer: {json.dumps(layer)}", flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
