"""One row a token into a paged cache (MLA's latent cache: layers/mla.py), skipping slots < 0.

The torch form (`store_rows_ref`) picks the kept rows with a boolean mask, which waits on the host for
their count; this kernel has a program per token that returns at once for a negative slot, so a CUDA graph
(whose padding rows have slot -1) can capture the write.
"""

from __future__ import annotations

import torch

from llmserve.kernels import next_pow2, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU wheel of torch ships without triton
    triton = None

if triton is not None:

    @triton.jit
    def _store_rows_kernel(rows_ptr, slots_ptr, cache_ptr, stride_r, D: tl.constexpr, D_PAD: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        if slot >= 0:
            d = tl.arange(0, D_PAD)
            row = tl.load(rows_ptr + t * stride_r + d, mask=d < D)
            tl.store(cache_ptr + slot * D + d, row.to(cache_ptr.dtype.element_ty), mask=d < D)


def store_rows_ref(rows: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    bs = cache.shape[2]
    cache[slots // bs, 0, slots % bs] = rows[keep].to(cache.dtype)


def store_rows(rows: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor) -> None:
    """rows [T, D] -> cache [blocks, 1, block_size, D] (contiguous) at slot_mapping [T] (slot = block *
    block_size + offset; < 0: not written), converted to the cache's dtype."""
    T, D = rows.shape
    assert cache.shape[1] == 1 and cache.shape[3] == D
    if T == 0:
        return
    if not use_triton(cache):
        return store_rows_ref(rows, slot_mapping, cache)
    assert cache.is_contiguous() and rows.stride(1) == 1
    _store_rows_kernel[(T,)](rows, slot_mapping, cache, rows.stride(0), D=D, D_PAD=next_pow2(D), num_warps=4)
