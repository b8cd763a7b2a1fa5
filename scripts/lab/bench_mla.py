#!/usr/bin/env python3
"""MLA's absorbed decode kernel (kernels/mla_decode.py) against the copy bandwidth of the same GPU.

Decode batches (one query a sequence, every sequence at `context` tokens) over a bf16 latent cache of
L + R = 512 + 64 features a row, blocks of the runner's size in random order, for V2-Lite's 16 heads and
V3's 128. Bytes: the cache rows read (batch x context x (L + R) x 2) plus q_lat read and the output
written; GB/s over the kernel's median time (CUDA events, L2 flushed before each run), and its ratio to a
device-to-device copy's (read + write) bandwidth measured in the same run. Also times the torch reference
(layers/mla.py `latent_attention`, one sequence at a time) at a small case, for scale.

`--interpret-smoke` runs a tiny case of the same setup under TRITON_INTERPRET=1 on the CPU against the
reference (checks the shapes here; no GPU needed).

Usage: PYTHONPATH=server python scripts/lab/bench_mla.py --out mla.json
"""

from __future__ import annotations

import os
import sys

if "--interpret-smoke" in sys.argv:  # triton reads it at import
    os.environ["TRITON_INTERPRET"] = "1"

import argparse
import functools
import json
import statistics
import time

import torch

from llmserve.config import Config
from llmserve.kernels.attention import AttnMeta
from llmserve.kernels.mla_decode import Launch, launch_shape, mla_decode
from llmserve.layers.mla import latent_attention

L, R = 512, 64
SCALE = (128 + 64) ** -0.5


def make_case(heads: int, batch: int, context: int, block_size: int, dtype: torch.dtype, device: str):
    """q_lat [batch, H, L + R], the cache (every sequence's blocks in random places) and its AttnMeta."""
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq
    cache = torch.empty(num_blocks, 1, block_size, L + R, dtype=dtype, device=device).normal_()
    bt = torch.randperm(num_blocks, device=device).view(batch, per_seq).int()
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttnMeta(
        torch.arange(batch + 1, **i32), torch.full((batch,), context, **i32), bt, None, None, 0
    )  # fmt: skip
    q = torch.empty(batch, heads, L + R, dtype=dtype, device=device).normal_()
    return q, cache, meta


def case_bytes(heads: int, batch: int, context: int, itemsize: int) -> int:
    """Cache rows read, q_lat read, output written."""
    return batch * context * (L + R) * itemsize + batch * heads * (L + R + L) * itemsize


def reference(q: torch.Tensor, cache: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
    """latent_attention one sequence at a time (the torch path's absorbed inner product)."""
    bs, outs = cache.shape[2], []
    for b, n in enumerate(meta.seq_lens.tolist()):
        pos = torch.arange(n, device=q.device)
        rows = cache[meta.block_tables[b, pos // bs].long(), 0, pos % bs].float()
        outs.append(latent_attention(q[b : b + 1].float(), rows, pos[-1:], SCALE, L))
    return torch.cat(outs)


def median_ms(fn, reps: int, flush: torch.Tensor | None = None) -> float:
    """Median over `reps` timed runs after 3 warm-ups; `flush` zeroed before each (L2 cold)."""
    times = []
    for i in range(reps + 3):
        if flush is not None:
            flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        if i >= 3:
            times.append(s.elapsed_time(e))
    return statistics.median(times)


def copy_gbs(gib: float = 2.0) -> float:
    """Read + write GB/s of a device-to-device copy (median of 10)."""
    a = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
    ms = median_ms(functools.partial(torch.empty_like(a).copy_, a), 10)
    return 2 * gib * (1 << 30) / ms / 1e6


def fits_memory(heads: int, batch: int, context: int) -> bool:
    need = case_bytes(heads, batch, context, 2) + batch * heads * L * 4 * 17  # plus partials at most
    return need * 1.2 < torch.cuda.mem_get_info()[0]


def parse_launch(spec: str | None) -> Launch | None:
    """ "block_h,block_n,warps,stages" (q_tile 1) or None: the kernel's own choice."""
    if not spec:
        return None
    h, n, w, s = (int(x) for x in spec.split(","))
    return Launch(h, 1, n, w, s)


def bench(args) -> dict:
    copy = copy_gbs()
    print(f"copy bandwidth (read + write): {copy:.0f} GB/s on {torch.cuda.get_device_name()}")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    print(f"{'H':>4} {'batch':>5} {'ctx':>6} {'launch':>22} {'ms':>8} {'GB/s':>7} {'of copy':>7}")
    for heads in args.heads:
        shape = parse_launch(args.launch) or launch_shape(heads, 1)
        for batch in args.batches:
            for ctx in args.contexts:
                if not fits_memory(heads, batch, ctx):
                    print(f"{heads:>4} {batch:>5} {ctx:>6} skipped: does not fit the free memory")
                    continue
                q, cache, meta = make_case(heads, batch, ctx, args.block_size, torch.bfloat16, "cuda")
                run = functools.partial(mla_decode, q, cache, meta, SCALE, L, shape=shape)
                ms = median_ms(run, args.reps, flush)
                gbs = case_bytes(heads, batch, ctx, 2) / ms / 1e6
                launch = f"h{shape.block_h} n{shape.block_n} w{shape.num_warps} s{shape.num_stages}"
                rows.append(
                    dict(heads=heads, batch=batch, context=ctx, ms=ms, gbs=gbs, of_copy=gbs / copy, launch=launch)
                )
                print(f"{heads:>4} {batch:>5} {ctx:>6} {launch:>22} {ms:8.3f} {gbs:7.0f} {gbs / copy:7.1%}")
                del q, cache, meta, run
    q, cache, meta = make_case(16, 4, 1024, args.block_size, torch.bfloat16, "cuda")
    err = (mla_decode(q, cache, meta, SCALE, L, out_dtype=torch.float32) - reference(q, cache, meta)).abs().max()
    ref_ms = median_ms(functools.partial(reference, q, cache, meta), 5)
    ker_ms = median_ms(functools.partial(mla_decode, q, cache, meta, SCALE, L), 5)
    print(f"torch reference, H 16, batch 4, ctx 1024: {ref_ms:.3f} ms (kernel {ker_ms:.3f} ms, max |diff| {err:.2e})")
    return dict(device=torch.cuda.get_device_name(), copy_gbs=copy, cases=rows, reference=dict(ms=ref_ms, kernel_ms=ker_ms, max_abs_diff=err.item()))  # fmt: skip


def smoke() -> None:
    """A tiny case of make_case's layout under the interpreter, against the reference."""
    t0 = time.time()
    for heads, ctx in ((16, 70), (128, 33)):
        q, cache, meta = make_case(heads, 2, ctx, 16, torch.float32, "cpu")
        err = (mla_decode(q, cache, meta, SCALE, L, out_dtype=torch.float32, splits=(2, 32)) - reference(q, cache, meta)).abs().max()  # fmt: skip
        assert err < 1e-4, (heads, err)
        print(f"interpreter smoke H {heads} ctx {ctx}: max |diff| {err:.1e}")
    print(f"ok ({time.time() - t0:.1f} s)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--heads", type=ints, default=[16, 128])
    p.add_argument("--batches", type=ints, default=[64, 256])
    p.add_argument("--contexts", type=ints, default=[1024, 4096, 16384])
    p.add_argument("--block-size", type=int, default=Config().block_size, help="default: the runner's BLOCK_SIZE")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--launch", help="block_h,block_n,warps,stages instead of the kernel's choice (tuning)")
    p.add_argument("--interpret-smoke", action="store_true", help="a tiny case under TRITON_INTERPRET=1 (CPU)")
    args = p.parse_args()
    if args.interpret_smoke:
        return smoke()
    if not torch.cuda.is_available():
        sys.exit("bench_mla.py needs a CUDA device (or --interpret-smoke)")
    with torch.inference_mode():
        result = bench(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
