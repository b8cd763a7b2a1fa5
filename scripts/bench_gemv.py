#!/usr/bin/env python3
"""Can a GEMV of our own beat cuBLAS at batch 1-4 on the 8B projections? (issue 17's next step; GPU.)

cuBLAS runs each decode-sized projection 3-5.5 us over its bytes at the copy bandwidth, split-K reduce
included (docs/gpu.md, call 91). The design this measures: a Triton GEMV that writes its split-K
partials in fp32, [S, M, N], for the next kernel to sum (the fused sum + RMSNorm after o and down, the
rotary kernel after qkv) instead of a reduce kernel of its own. For each projection (one rank's share
at --mp 2, and the whole at MP_NUM=1) and M = 1 and 4: cuBLAS (`x @ W.T`, fp32 out, as the model calls
it) against a sweep of tiles and split counts, each timed alone in a CUDA graph over enough distinct
weights to miss L2, each checked against cuBLAS first. Prints each shape's best and writes JSON.

    PYTHONPATH=server python scripts/bench_gemv.py --out gemv.json
    TRITON_INTERPRET=1 PYTHONPATH=server python scripts/bench_gemv.py --check-only   # the kernel on a CPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton
import triton.language as tl
from bench_quant_gemm import copy_bandwidth, time_graph  # CUDA-graph timing over weight copies


@triton.jit
def gemv_partials_kernel(
    x_ptr,  # [M, K] bf16
    w_ptr,  # [N, K] bf16, K contiguous
    out_ptr,  # [S, M, N] fp32 partials
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k0 = split * k_per_split
    for k in range(k0, tl.minimum(k0 + k_per_split, K), BLOCK_K):
        kk = k + rk
        x = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w))
    out = out_ptr + split * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemv_partials(x: torch.Tensor, w: torch.Tensor, splits: int, block_n: int, block_k: int, warps: int, stages: int):
    M, K = x.shape
    N = w.shape[0]
    k_per_split = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    splits = triton.cdiv(K, k_per_split)
    out = torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    gemv_partials_kernel[(triton.cdiv(N, block_n), splits)](
        x,
        w,
        out,
        M,
        N,
        K,
        k_per_split,
        BLOCK_M=16,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def shapes(mp: int) -> list[tuple[str, int, int]]:
    h, f, kvd = 4096, 14336, 1024
    return [("qkv", (h + 2 * kvd) // mp, h), ("o", h, h // mp), ("gate_up", 2 * f // mp, h), ("down", h, f // mp)]


def check(device: str) -> None:
    """The kernel against a float64 product, on random inputs (rows 1-4, ragged N and K); bf16 on a GPU,
    fp32 under the interpreter (its numpy has no bf16)."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for M, N, K, splits in [(1, 96, 320, 1), (3, 200, 1000, 4), (4, 64, 512, 3)]:
        x = torch.randn(M, K, generator=gen).to(dtype).to(device)
        w = torch.randn(N, K, generator=gen).to(dtype).to(device)
        got = gemv_partials(x, w, splits, 32, 128, 4, 2).sum(0).double().cpu()
        want = x.double().cpu() @ w.double().cpu().T
        err = (got - want).abs().max().item()
        assert err < 1e-3 * K**0.5, (M, N, K, splits, err)
        print(f"check M={M} N={N} K={K} splits={splits}: max error {err:.2e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemv.json")
    ap.add_argument("--check-only", action="store_true")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check(device)
    if a.check_only or device == "cpu":
        return
    res: dict = {"device": torch.cuda.get_device_name(), "copy_tb_s": None, "shapes": {}}
    res["copy_tb_s"] = bw = copy_bandwidth() / 1e12
    configs = list(itertools.product((32, 64, 128), (128, 256, 512), (4,), (3, 4)))  # BLOCK_N, BLOCK_K, warps, stages
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for mp in (2, 1):
        for name, N, K in shapes(mp):
            Ws = [
                torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(max(4, int(400e6 // (N * K * 2))))
            ]
            floor = N * K * 2 / (bw * 1e12) * 1e6
            for M in (1, 4):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                cublas = time_graph(lambda i, x=x, Ws=Ws: torch.mm(x, Ws[i].t(), torch.float32), len(Ws))
                row: dict = {"floor_us": floor, "cublas_us": cublas}
                want = torch.mm(x, Ws[0].t(), torch.float32)
                best = None
                for bn, bk, warps, stages in configs:
                    tiles = triton.cdiv(N, bn)
                    for waves in (1, 2, 4):
                        splits = max(1, min(K // bk, round(waves * sms / tiles)))
                        key = f"n{bn}_k{bk}_w{warps}_s{stages}_split{splits}"
                        if key in row:
                            continue
                        try:
                            got = gemv_partials(x, Ws[0], splits, bn, bk, warps, stages).sum(0)
                            if not torch.allclose(got, want, rtol=1e-2, atol=1e-2):
                                row[key] = "wrong"
                                continue
                            cfg = (splits, bn, bk, warps, stages)
                            us = time_graph(lambda i, x=x, Ws=Ws, cfg=cfg: gemv_partials(x, Ws[i], *cfg), len(Ws))
                        except Exception as e:  # noqa: BLE001 - a tile that does not fit is reported, not fatal
                            row[key] = repr(e)[:120]
                            continue
                        row[key] = us
                        if best is None or us < row[best]:
                            best = key
                row["best"] = best
                res["shapes"][f"mp{mp}:{name}:m{M}"] = row
                print(
                    f"mp{mp} {name:8s} M={M}: floor {floor:6.1f} us, cuBLAS {row['cublas_us']:6.1f}, "
                    f"ours {row[best]:6.1f} ({best}; partials not summed)"
                    if best
                    else f"mp{mp} {name} M={M}: none ran",
                    flush=True,
                )
                with open(a.out, "w") as f:
                    json.dump(res, f, indent=1)
            del Ws


if __name__ == "__main__":
    main()
