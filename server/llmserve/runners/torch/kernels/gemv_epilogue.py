"""What the batch-1 GEMVs (gemv.py over 8/16-bit weights, gemv4.py over 4-bit ones) share: which rows a program
owns, and what becomes of its finished rows (gemv.py's docstring: stored, pushed into a fused sum, SwiGLU, or
rotary + cache write)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    from .rotary import rope_pairs
    from .sum_norm import push_words
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def gemv_rows(pid, N, BLOCK_N: tl.constexpr, EPI: tl.constexpr, HALF: tl.constexpr):
        """(rows, which exist) of program `pid`. EPI 2 and 3 take rows in pairs, adjacent in the program: gate j
        and up j (N: the outputs, half the rows); a head's j and j + HALF."""
        if EPI == 2:
            i = tl.arange(0, BLOCK_N)
            ro = pid * (BLOCK_N // 2) + i // 2
            return ro + (i % 2) * N, ro < N
        if EPI == 3:
            i = tl.arange(0, BLOCK_N)
            t = pid * (BLOCK_N // 2) + i // 2
            rn = (t // HALF) * (2 * HALF) + t % HALF + (i % 2) * HALF
            return rn, rn < N
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        return rn, rn < N

    @triton.jit
    def gemv_finish(
        y,  # fp32 [BLOCK_N]: the program's rows, scaled
        rn,
        n_ok,
        pid,
        N,
        b_ptr,
        out_ptr,
        bases_ptr,
        epochs_ptr,
        slot,
        pos_ptr,
        slot_ptr,
        cs_ptr,
        k_cache_ptr,
        v_cache_ptr,
        stride_cb,
        stride_ch,
        num_heads,
        num_kv_heads,
        HAS_BIAS: tl.constexpr,
        EPI: tl.constexpr,  # 0 stored, 1 pushed, 2 SwiGLU, 3 rotary + cache
        RANK: tl.constexpr,
        WORLD: tl.constexpr,
        HALF: tl.constexpr,
        CACHE_BLOCK: tl.constexpr,
        LIMIT: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        if EPI == 1:  # the fused sum's next call (it adds the 1 to the epoch itself)
            push_words(y, rn, n_ok, bases_ptr, tl.load(epochs_ptr) + 1, slot, RANK, WORLD)
        elif EPI == 2:  # silu(gate) * up, as kernels/activation.py computes it from the fp32 rows
            g, u = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))
            ro = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(out_ptr + ro, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=ro < N)
        elif EPI == 3:  # kernels/rotary.py's rotation and cache write, for the program's pairs
            x1, x2 = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))
            r1 = tl.split(tl.reshape(rn, (BLOCK_N // 2, 2)))[0]
            pos, slot = tl.load(pos_ptr).to(tl.int64), tl.load(slot_ptr).to(tl.int64)
            rope_pairs(
                x1, x2, r1, r1 < N, out_ptr, pos, slot, cs_ptr, k_cache_ptr, v_cache_ptr, stride_cb,
                stride_ch, num_heads, num_kv_heads, HALF, CACHE_BLOCK, LIMIT,
            )  # fmt: skip
        else:
            tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=n_ok)
