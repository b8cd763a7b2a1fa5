#!/usr/bin/env python3
"""The 4-bit GEMV (kernels/gemv4.py) against PyTorch's tinygemm at 1-4 rows of x (issue 15; GPU).

For each projection of the 8B shape, random weights quantized to canonical w4 (group 128): microseconds a layer
(qkv + o + gate_up + down) of `gemv` on the 4-bit operands and of `aten._weight_int4pack_mm` on tinygemm's, fp32
out as the model asks (tinygemm writes bf16: its cast to fp32 is counted), and the floor (the 4-bit weights and
a word a group at this run's copy bandwidth). CUDA-graph replays over enough weight copies to miss L2.

    PYTHONPATH=server:scripts python scripts/lab/bench_gemv4.py --out gemv4_rows.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from llmserve.kernels.gemv import gemv
from llmserve.kernels.gemv4 import gemv4_operands
from llmserve.layers.quant import formats
from llmserve.layers.quant.methods import tinygemm_operands


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemv4_rows.json")
    ap.add_argument("--rows", default="1,2,3,4")
    a = ap.parse_args()
    from bench_quant_gemm import copy_bandwidth, time_graph

    res: dict = {"device": torch.cuda.get_device_name(), "layer_us": {}}
    res["copy_tb_s"] = bw = copy_bandwidth() / 1e12
    h, f, kvd, G, f32 = 4096, 14336, 1024, 128, torch.float32
    layer: dict[str, float] = {}
    for N, K in ((h + 2 * kvd, h), (h, h), (2 * f, h), (h, f)):
        copies = max(4, int(800e6 // (N * K)))
        ops, tg = [], []
        for _ in range(copies):
            q, s, z = formats.quantize_w4(torch.randn(N, K, device="cuda"), G)
            ops.append(gemv4_operands(q, s, z))
            tg.append(tinygemm_operands(q, s, z, G))
        layer["floor"] = layer.get("floor", 0.0) + (ops[0][0].numel() + ops[0][1].numel()) * 4 / (bw * 1e6)
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            mine = time_graph(lambda i, x=x, ops=ops: gemv(x, ops[i][0], ops[i][1], 0, None, f32), copies)
            theirs = time_graph(
                lambda i, x=x, tg=tg: torch.ops.aten._weight_int4pack_mm(x, tg[i][0], G, tg[i][1]).to(f32), copies
            )
            layer[f"gemv4_m{m}"] = layer.get(f"gemv4_m{m}", 0.0) + mine
            layer[f"tinygemm_m{m}"] = layer.get(f"tinygemm_m{m}", 0.0) + theirs
        del ops, tg
        torch.cuda.empty_cache()
    res["layer_us"] = layer
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
