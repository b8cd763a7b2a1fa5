#!/usr/bin/env python3
"""kernels/skinny.py (products of 2-16 rows over bf16 weights) against cuBLAS and the one-row GEMV (issue 14; GPU).

For each projection of the 8B shape (whole, and one rank's share at MP_NUM=2 with --mp2) and its LM head, and each
row count of --rows: bf16 cuBLAS (`torch.mm(x, W.T, fp32)`, as the model calls it), the one-row GEMV (kernels/gemv.py,
the plain step's product: what a verification step's products would cost at the plain step's speed), the weights'
floor (their bytes at this run's copy bandwidth), and the skinny kernel over a set of launches (BLOCK_N, BLOCK_K,
warps, stages), every launch checked against cuBLAS first. Then, per row count, the layer's sum (qkv + o + gate_up +
down) of each, and of the launches that are best over the whole layer. Each timing is CUDA-graph replays over enough
weight copies to miss L2 (bench_quant_gemm.time_graph).

    PYTHONPATH=server:scripts python scripts/lab/sweep_skinny.py --out skinny_sweep.json [--rows 2,5,16] [--mp2]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from llmserve.kernels.gemv import gemv
from llmserve.kernels.skinny import skinny, skinny_launch

LAUNCHES = [(n, k, 4, s) for n, k, s in itertools.product((16, 32, 64), (128, 256), (3, 4, 5))]
LAUNCHES += [(64, 128, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (16, 512, 4, 3)]
LAUNCHES += [(32, 128, 4, 6), (16, 256, 4, 6), (64, 64, 4, 6), (32, 64, 4, 8)]


def shapes(mp: int) -> list[tuple[str, int, int]]:
    h, f, kvd, vocab = 4096, 14336, 1024, 128256
    return [
        ("qkv", (h + 2 * kvd) // mp, h),
        ("o", h, h // mp),
        ("gate_up", 2 * f // mp, h),
        ("down", h, f // mp),
        ("lm_head", vocab // mp, h),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="skinny_sweep.json")
    ap.add_argument("--rows", default="2,5,16")
    ap.add_argument("--mp2", action="store_true", help="also one rank's share at MP_NUM=2")
    a = ap.parse_args()
    from bench_quant_gemm import copy_bandwidth, time_graph

    f32 = torch.float32
    res: dict = {"device": torch.cuda.get_device_name(), "launches": LAUNCHES}
    res["copy_tb_s"] = bw = copy_bandwidth() / 1e12
    rows = [int(m) for m in a.rows.split(",")]
    out = Path(a.out)
    for mp in (1, 2) if a.mp2 else (1,):
        for name, N, K in shapes(mp):
            copies = max(3, int(600e6 // (2 * N * K)))
            ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            x1 = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
            shape_res: dict = {"floor_us": 2 * N * K / (bw * 1e12) * 1e6, "default_launch": skinny_launch(N, K)}
            shape_res["gemv_1row_us"] = time_graph(lambda i, x=x1, ws=ws: gemv(x, ws[i], None, 0, None, f32), copies)
            for M in rows:
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                row: dict = {"cublas_us": time_graph(lambda i, x=x, ws=ws: torch.mm(x, ws[i].t(), f32), copies)}
                want = torch.mm(x, ws[0].t(), f32)
                for cfg in LAUNCHES:
                    key = "n{}_k{}_w{}_s{}".format(*cfg)
                    try:
                        got = skinny(x, ws[0], None, f32, config=cfg)
                        if not torch.allclose(got, want, rtol=1e-3, atol=1e-3):
                            row[key] = "wrong"
                            continue
                        row[key] = time_graph(
                            lambda i, x=x, ws=ws, c=cfg: skinny(x, ws[i], None, f32, config=c), copies
                        )
                    except Exception as e:  # noqa: BLE001 - a launch that does not compile (shared memory) is reported
                        row[key] = repr(e)[:160]
                timed = {k: v for k, v in row.items() if k.startswith("n") and isinstance(v, float)}
                row["best"] = min(timed, key=timed.get) if timed else None
                shape_res[f"m{M}"] = row
                best = f"{row['best']} {timed[row['best']]:.1f}" if timed else "none"
                print(
                    f"mp{mp} {name:8s} N={N} K={K} M={M}: floor {shape_res['floor_us']:.1f} us, gemv(1 row) "
                    f"{shape_res['gemv_1row_us']:.1f}, cuBLAS {row['cublas_us']:.1f}, skinny best {best}",
                    flush=True,
                )
            res[f"mp{mp}:{name}"] = shape_res
            out.write_text(json.dumps(res, indent=1))
            del ws
            torch.cuda.empty_cache()
        for M in rows:  # over a layer (the LM head apart): each launch's sum, and the baselines'
            layer = [res[f"mp{mp}:{n}"] for n, _, _ in shapes(mp) if n != "lm_head"]
            summ: dict = {k: sum(s[k] for s in layer) for k in ("floor_us", "gemv_1row_us")}
            summ["cublas_us"] = sum(s[f"m{M}"]["cublas_us"] for s in layer)
            keys = set.intersection(*({k for k, v in s[f"m{M}"].items() if isinstance(v, float)} for s in layer))
            per = {k: sum(s[f"m{M}"][k] for s in layer) for k in keys if k.startswith("n")}
            summ["skinny_best5"] = {k: per[k] for k in sorted(per, key=per.get)[:5]}
            summ["per_shape_best_us"] = sum(min(v for k, v in s[f"m{M}"].items() if k in per) for s in layer)
            res[f"layer_mp{mp}_m{M}"] = summ
            print(f"mp{mp} layer M={M}: {json.dumps(summ)}", flush=True)
        out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
