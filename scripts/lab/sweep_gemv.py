#!/usr/bin/env python3
"""The batch-1 GEMV over 8-bit weights (kernels/gemv.py) against today's decode kernels (issue 15; GPU).

For each projection of the 8B shape (whole, and one rank's share at MP_NUM=2; --lm-head: and the LM head),
one row of x:
  - baselines (unless --no-baselines): the w8a16 tensor-core kernel and the FP8 path as they ran before
    the GEMV (`w8a16_linear` / `fp8_linear` with one row, fp32 out as the model calls them, timed with
    the GEMV turned off), bf16 cuBLAS, and the floor (the int8 bytes at the copy bandwidth of this run);
  - the GEMV for each of --formats (int8, fp8 per row, fp8b with 128 x 128 block scales, bf16 without a
    scale) over a set of launches (rows per program, K tile, warps, next tile prefetched or not), int8
    also with the compiler's conversion at two launches; every launch checked against the reference first.
Each timing is CUDA-graph replays over enough weight copies to miss L2 (bench_quant_gemm.time_graph).

    PYTHONPATH=server python scripts/lab/sweep_gemv.py --out gemv_sweep.json [--formats int8,fp8,fp8b,bf16]
    TRITON_INTERPRET=1 PYTHONPATH=server python scripts/lab/sweep_gemv.py --check-only   # on a CPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

import torch

from llmserve.kernels.gemv import gemv, gemv_ref


def check(device: str) -> None:
    """gemv against the dequantized fp32 product on random inputs: int8 and FP8, per-row and block
    scales, ragged N and K, bias, bf16 and fp32 out."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    cases = [(96, 320, 0, torch.int8), (200, 1000, 0, torch.int8), (72, 384, 128, torch.float8_e4m3fn)]
    cases += [(130, 256, 128, torch.int8), (64, 512, 0, torch.float8_e4m3fn)]
    for N, K, block, wdt in cases:
        x = torch.randn(1, K, generator=gen).to(torch.bfloat16)
        if wdt == torch.int8:
            w = torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8)
        else:
            w = (torch.randn(N, K, generator=gen) * 4).to(wdt)
        sshape = (-(-N // block), -(-K // block)) if block else (N,)
        s = torch.rand(sshape, generator=gen) * 0.01 + 1e-3
        b = torch.randn(N, generator=gen).to(torch.bfloat16)
        x, w, s, b = (t.to(device) for t in (x, w, s, b))
        for out_dtype, bias, cfg in [(torch.float32, None, (16, 128, 4, 0)), (torch.bfloat16, b, (8, 256, 2, 1))]:
            got = gemv(x, w, s, block, bias, out_dtype, config=cfg).float().cpu()
            want = gemv_ref(x, w, s, block, bias, torch.float32).cpu()
            tol = 1e-5 * K**0.5 if out_dtype == torch.float32 else 1e-2
            err = ((got - want).abs() / (want.abs() + 1)).max().item()
            assert err < tol, (N, K, block, wdt, out_dtype, err)
            print(f"check N={N} K={K} block={block} {wdt} -> {out_dtype}: max rel error {err:.1e}", flush=True)


def shapes(mp: int, lm_head: bool) -> list[tuple[str, int, int]]:
    h, f, kvd, vocab = 4096, 14336, 1024, 128256
    rows = [("qkv", (h + 2 * kvd) // mp, h), ("o", h, h // mp), ("gate_up", 2 * f // mp, h), ("down", h, f // mp)]
    return rows + [("lm_head", vocab // mp, h)] if lm_head else rows


# format -> (weight dtype, scale block: 0 per row, None no scale)
FORMATS = {"int8": (torch.int8, 0), "fp8": (torch.float8_e4m3fn, 0), "fp8b": (torch.float8_e4m3fn, 128)}
FORMATS["bf16"] = (torch.bfloat16, None)
LAUNCHES = {  # (BLOCK_N, BLOCK_K, num_warps, PREFETCH)
    "full": list(itertools.product((8, 16, 32), (256, 512, 1024), (2, 4, 8), (0, 1))),
    "near": list(itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8), (0, 1))),
    "edge": [(2, 2048, 4, 0), (2, 4096, 4, 0), (4, 4096, 4, 0), (4, 2048, 2, 0), (4, 2048, 4, 0), (4, 1024, 4, 0)]
    + [(8, 1024, 4, 0), (16, 512, 8, 0), (16, 256, 4, 0), (4, 4096, 8, 0)],
}


def weights(fmt: str, N: int, K: int, copies: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    dtype, block = FORMATS[fmt]
    if dtype == torch.int8:
        ws = [torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda") for _ in range(copies)]
    else:
        ws = [(torch.randn(N, K, device="cuda") * (4 if block is not None else 0.02)).to(dtype) for _ in range(copies)]
    if block is None:
        return ws, None
    shape = (-(-N // block), -(-K // block)) if block else (N,)
    return ws, torch.rand(shape, device="cuda") * 0.01


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemv_sweep.json")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--formats", default="int8,fp8", help=f"of {sorted(FORMATS)}")
    ap.add_argument("--launches", default="full", choices=sorted(LAUNCHES))
    ap.add_argument("--lm-head", action="store_true", help="also the LM head (128256 x 4096)")
    ap.add_argument("--no-baselines", action="store_true")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check(device)
    if a.check_only or device == "cpu":
        return
    from bench_quant_gemm import copy_bandwidth, time_graph  # CUDA-graph timing over weight copies

    from llmserve.kernels import switches
    from llmserve.kernels.fp8_gemm import fp8_linear
    from llmserve.kernels.quant_gemm import w8a16_linear

    res: dict = {"device": torch.cuda.get_device_name(), "formats": a.formats, "launches": a.launches, "shapes": {}}
    res["copy_tb_s"] = bw = copy_bandwidth() / 1e12
    out = Path(a.out)
    fmts = a.formats.split(",")
    f32 = torch.float32
    for mp in (1, 2):
        for name, N, K in shapes(mp, a.lm_head):
            copies = max(4, int(400e6 // (N * K)))
            x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
            row: dict = {"floor_int8_us": N * K / (bw * 1e12) * 1e6}
            if not a.no_baselines:
                switches.current.gemv = False  # the paths as they ran before the GEMV
                q8, s8 = weights("int8", N, K, copies)
                row["w8a16_us"] = time_graph(lambda i, x=x, q8=q8, s8=s8: w8a16_linear(x, q8[i], s8, None, f32), copies)
                del q8
                f8, _ = weights("fp8", N, K, copies)
                row["fp8_linear_us"] = time_graph(
                    lambda i, x=x, f8=f8, s8=s8: fp8_linear(x, f8[i], s8, None, None, f32), copies
                )
                del f8
                bf = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(max(4, copies // 2))]
                row["bf16_cublas_us"] = time_graph(lambda i, x=x, bf=bf: torch.mm(x, bf[i].t(), f32), len(bf))
                del bf
                switches.current.gemv = True
            for fmt in fmts:
                _, block = FORMATS[fmt]
                ws, s = weights(fmt, N, K, copies if fmt != "bf16" else max(4, copies // 2))
                want = gemv_ref(x, ws[0], s, block or 0, None, f32)
                convs = (0, 1) if fmt == "int8" else (0,)
                for conv, cfg in itertools.product(convs, LAUNCHES[a.launches]):
                    if conv == 0 and fmt == "int8" and cfg not in ((8, 1024, 4, 0), (16, 256, 4, 0)):
                        continue  # the compiler's conversion at two launches only
                    key = f"{fmt}_c{conv}_n{cfg[0]}_k{cfg[1]}_w{cfg[2]}_p{cfg[3]}"
                    try:
                        got = gemv(x, ws[0], s, block or 0, None, f32, config=cfg, conv=conv)
                        if not torch.allclose(got, want, rtol=1e-3, atol=1e-3):
                            row[key] = "wrong"
                            continue

                        def fn(i, x=x, ws=ws, s=s, cfg=cfg, c=conv, b=block or 0):
                            return gemv(x, ws[i], s, b, None, f32, cfg, c)

                        row[key] = time_graph(fn, len(ws))
                    except Exception as e:  # noqa: BLE001 - a launch that does not compile is reported, not fatal
                        row[key] = repr(e)[:160]
                del ws
                torch.cuda.empty_cache()
            best = {}
            for fmt in fmts:
                timed = {k: v for k, v in row.items() if k.startswith(fmt + "_") and isinstance(v, float)}
                if timed:
                    best[fmt] = min(timed, key=timed.get)
            row["best"] = best
            res["shapes"][f"mp{mp}:{name}"] = row
            out.write_text(json.dumps(res, indent=1))
            fl = row["floor_int8_us"]
            base = " | ".join(f"{k} {row[k]:5.1f}" for k in ("w8a16_us", "fp8_linear_us", "bf16_cublas_us") if k in row)
            print(
                f"mp{mp} {name:8s} N={N} K={K}: int8 floor {fl:5.1f} us | {base} | "
                + " | ".join(f"{f} {row[k]:5.1f} ({k})" for f, k in best.items()),
                flush=True,
            )
    # one launch for every shape: the sum over a layer of each launch's time, by format
    for mp in (1, 2):
        rows = [r for k, r in res["shapes"].items() if k.startswith(f"mp{mp}:") and not k.endswith("lm_head")]
        layer_row: dict = {"floor_int8_us": sum(r["floor_int8_us"] for r in rows)}
        for k in ("w8a16_us", "fp8_linear_us", "bf16_cublas_us"):
            if all(k in r for r in rows):
                layer_row[k] = sum(r[k] for r in rows)
        for fmt in fmts:
            keys = set.intersection(
                *({k for k, v in r.items() if k.startswith(fmt + "_") and isinstance(v, float)} for r in rows)
            )
            layer = {k: sum(r[k] for r in rows) for k in keys}
            layer_row[fmt] = {k: layer[k] for k in sorted(layer, key=layer.get)[:5]}
        res[f"layer_mp{mp}"] = layer_row
        print(f"mp{mp} per layer: {json.dumps(layer_row)}", flush=True)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
