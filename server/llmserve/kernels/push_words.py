"""The words a row-parallel GEMV pushes into every rank's buffer (sum_norm.py's FusedSumNorm reads them):
the one device function that kernels/gemv_epilogue.py and kernels/sum_norm.py share."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def push_words(x, at, mask, bases_ptr, epoch, slot, RANK: tl.constexpr, WORLD: tl.constexpr):
        """fp32 `x` as this call's words (value | epoch << 32) at offsets `at` of this rank's slot of every
        rank's buffer (the half of the epoch's parity); pushed: remote stores do not wait for a reply."""
        tag = epoch & 0xFFFFFFFF
        word = (x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF) | (tag << 32)
        at += ((epoch % 2) * WORLD + RANK) * slot
        for r in tl.static_range(WORLD):
            base = tl.load(bases_ptr + r).to(tl.pointer_type(tl.int64))
            tl.store(base + at, word, mask=mask)
