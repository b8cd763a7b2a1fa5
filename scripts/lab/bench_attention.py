#!/usr/bin/env python3
"""Prefill attention over the paged cache: our kernel's launch shapes against torch's flash attention.

Times `paged_attention` (8B shape: 32 heads, 8 KV heads, D 128, fp16 cache, blocks of 64) on prefill
cases, for every prefill tile shape in VARIANTS, and reports causal TFLOP/s:
F = 4 H D (n c + n (n + 1) / 2) for a chunk of n tokens after c cached ones. The reference rate is
torch's scaled_dot_product_attention (flash, causal; K/V repeated to every head) on the same
prompts laid out densely.
Every variant's output is compared with the default shape's (max abs difference).

`--decode` instead times decode-only batches (one query token a sequence, as the runner lays them
out: its split-KV choice included) for every decode tile in DECODE_VARIANTS, and reports the K/V
bytes read per second against the copy bandwidth measured in the same run.

Usage: PYTHONPATH=server python scripts/lab/bench_attention.py --out attn.json [--decode]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: bench_gpu's timing helpers
from bench_gpu import copy_bandwidth, gpu_ms  # noqa: E402

from llmserve.kernels import attention as A
from llmserve.runners.torch.inputs import work_items

H, KVH, D, BS = 32, 8, 128, 64


def _i32(x) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x), dtype=torch.int32, device="cuda")


def block_table(seq_lens) -> tuple[torch.Tensor, int]:
    """Block table (CPU) of sequences of `seq_lens` tokens, their blocks laid out in order; blocks used."""
    nblk = [-(-int(n) // BS) for n in seq_lens]
    bt = torch.zeros(len(nblk), max(nblk), dtype=torch.int32)
    nxt = 0
    for i, n in enumerate(nblk):
        bt[i, :n] = torch.arange(nxt, nxt + n)
        nxt += n
    return bt, nxt


def case(ctxs: list[int], q_lens: list[int]):
    """(q, meta builder, flops): chunks of q_lens tokens after ctxs cached ones, blocks laid out in order."""
    bt, nxt = block_table([c + n for c, n in zip(ctxs, q_lens)])
    q_lens_a = np.asarray(q_lens)
    cu = np.concatenate([[0], np.cumsum(q_lens_a)])
    seq_lens = np.asarray(ctxs) + q_lens_a
    T = int(cu[-1])
    q = torch.randn(T, H, D, device="cuda", dtype=torch.float32)

    def meta() -> A.AttnMeta:
        block_t = A.tile_tokens(H, KVH, decode_only=False)
        single = q_lens_a == 1
        item_seq, item_q = work_items(np.where(single, 0, q_lens_a), block_t)
        dec = np.flatnonzero(single)
        t = _i32
        return A.AttnMeta(
            t(cu), t(seq_lens), bt.cuda(), t(item_seq), t(item_q), block_t, 1, t(dec), t(np.zeros_like(dec)),
            A.tile_tokens(H, KVH, True),
        )  # fmt: skip

    flops = sum(4 * H * D * (n * c + n * (n + 1) / 2) for c, n in zip(ctxs, q_lens))
    return q, meta, flops, nxt


DECODE_VARIANTS = [
    A.Tile(16, n, w, s) for n, w, s in itertools.product([32, 64, 128], [2, 4, 8], [2, 3, 4, 5]) if n * s <= 512
]


def decode_main(out: str) -> None:
    """Decode batches of 64 and 256 sequences with 400-1,000 cached tokens each, and one of 1,000. Outside
    a CUDA graph a call this small is timed mostly by its launches: the batch of 1 says little."""
    from llmserve.runners.torch.cuda_graphs import decode_splits

    rng = np.random.default_rng(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth()
    res: dict = {
        "device": torch.cuda.get_device_name(),
        "copy_tb_s": bw / 1e12,
        "default": dataclasses.asdict(A.DECODE_TILE),
        "cases": {},
    }
    default = A.DECODE_TILE
    for B in (1, 64, 256):
        ctxs = rng.integers(400, 1001, B).tolist() if B > 1 else [1000]
        seq_lens = np.asarray(ctxs) + 1
        bt, nxt = block_table(seq_lens)
        kc = torch.randn(nxt, KVH, BS, D, device="cuda", dtype=torch.float16)
        vc = torch.randn_like(kc)
        q = torch.randn(B, H, D, device="cuda", dtype=torch.float32)
        t = _i32
        kv_bytes = int(seq_lens.sum()) * KVH * D * 2 * 2
        rows, want = [], None
        for v in [default] + [v for v in DECODE_VARIANTS if v != default]:
            A.DECODE_TILE = v
            try:
                block_t = A.tile_tokens(H, KVH, decode_only=True)
                m = A.AttnMeta(t(np.arange(B + 1)), t(seq_lens), bt.cuda(), t(np.arange(B)), t(np.zeros(B)), block_t,
                               decode_splits(B, KVH, sms))  # fmt: skip
                o = A.paged_attention(q, kc, vc, m, D**-0.5, torch.bfloat16)
                ms = gpu_ms(lambda m=m, q=q, kc=kc, vc=vc: A.paged_attention(q, kc, vc, m, D**-0.5, torch.bfloat16), 50)
            except Exception as e:  # noqa: BLE001 - a shape that does not fit (shared memory)
                rows.append(dict(tile=dataclasses.asdict(v), error=repr(e)[:200]))
                continue
            finally:
                A.DECODE_TILE = default
            want = o if want is None else want
            err = (o.float() - want.float()).abs().max().item()
            rows.append(
                dict(
                    tile=dataclasses.asdict(v),
                    ms=ms,
                    kv_tb_s=kv_bytes / ms / 1e9,
                    of_copy_bw=kv_bytes / ms / 1e-3 / bw,
                    max_diff=err,
                )
            )
        ok = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
        res["cases"][f"decode_{B}"] = dict(
            kv_bytes=kv_bytes, default=rows[0], best=ok[:6], errors=[r for r in rows if "error" in r][:3]
        )
        print(f"decode_{B}", json.dumps(dict(default=rows[0], best=ok[:3])), flush=True)
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attn.json")
    ap.add_argument("--decode", action="store_true", help="sweep the decode tile on decode-only batches")
    a = ap.parse_args()
    if a.decode:
        return decode_main(a.out)
    rng = np.random.default_rng(0)
    cases = {
        "prefill_1848": ([0], [1848]),
        "prefill_4x512": ([0] * 4, [512] * 4),
        "chunk_2048_after_2048": ([2048], [2048]),
        "mixed_200dec_1848pf": (rng.integers(400, 1000, 200).tolist() + [0], [1] * 200 + [1848]),
    }
    default = dataclasses.replace(A.PREFILL_TILE)
    variants = [default] + [
        A.Tile(r, n, w, s)
        for r, n, w, s in itertools.product([64, 128], [64, 128], [4, 8], [1, 2, 3, 4])
        if (r, n, w, s) != dataclasses.astuple(default)
    ]
    res: dict = {"device": torch.cuda.get_device_name(), "default": dataclasses.asdict(default), "cases": {}}
    for name, (ctxs, q_lens) in cases.items():
        q, meta, flops, nblocks = case(ctxs, q_lens)
        kc = torch.randn(nblocks, KVH, BS, D, device="cuda", dtype=torch.float16)
        vc = torch.randn_like(kc)
        rows, want = [], None
        for v in variants:
            A.PREFILL_TILE = v
            try:
                m = meta()
                out = A.paged_attention(q, kc, vc, m, D**-0.5, torch.bfloat16)
                ms = gpu_ms(lambda m=m, q=q, kc=kc, vc=vc: A.paged_attention(q, kc, vc, m, D**-0.5, torch.bfloat16), 20)
            except Exception as e:  # noqa: BLE001 - a shape that does not fit (shared memory)
                rows.append(dict(tile=dataclasses.asdict(v), error=repr(e)[:200]))
                continue
            if want is None:
                want = out
            err = (out.float() - want.float()).abs().max().item()
            rows.append(dict(tile=dataclasses.asdict(v), ms=ms, tflops=flops / ms / 1e9, max_diff=err))
        A.PREFILL_TILE = default
        ok = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
        entry = dict(flops=flops, default=rows[0], best=ok[:5], errors=[r for r in rows if "error" in r][:3])
        if all(c == 0 for c in ctxs) and min(q_lens) > 1:  # dense flash reference, one prompt at a time
            dense = [
                (torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16),
                 torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16),
                 torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16))
                for n in q_lens
            ]  # fmt: skip

            def sdpa(dense=dense):
                for qq, kk, vv in dense:
                    F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)

            try:
                ms = gpu_ms(sdpa, 20)
                entry["torch_sdpa"] = dict(ms=ms, tflops=flops / ms / 1e9)
            except Exception as e:  # noqa: BLE001
                entry["torch_sdpa"] = dict(error=repr(e)[:200])
        res["cases"][name] = entry
        print(name, json.dumps(dict(default=rows[0], best=ok[:3], sdpa=entry.get("torch_sdpa"))), flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
