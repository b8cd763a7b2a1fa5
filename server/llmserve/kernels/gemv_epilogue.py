"""What the batch-1 GEMVs (gemv.py over 8/16-bit weights, gemv4.py over 4-bit ones) share: which rows a program
owns, and what becomes of its finished rows (gemv.py's docstring: stored, pushed into a fused sum, SwiGLU, rotary + cache
write, or added into the output), and the pending RMSNorm that a GEMV reads or leaves (gemv.py: `NormedRow`)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    from llmserve.kernels.push_words import push_words
    from llmserve.kernels.rotary import rope_pairs
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
    def norm_parts(parts_ptr, n_parts, NORM: tl.constexpr, PARTS: tl.constexpr):
        """The sums of squares of a pending norm's input (NormedRow.parts: one a program of the GEMV that left it),
        loaded before the main loop, so that their latency hides behind the weights'."""
        if NORM:
            return tl.load(parts_ptr + tl.arange(0, PARTS), mask=tl.arange(0, PARTS) < n_parts, other=0.0)
        return tl.zeros((PARTS,), dtype=tl.float32)

    @triton.jit
    def norm_factor(parts, K, eps):
        """1 / rms of the norm's input row from its parts, summed in one order: the same bits in every program."""
        return tl.rsqrt(tl.sum(parts, axis=0) / K + eps)

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
        u_ptr,  # NEXT: the next norm's pending row (x * its weight) and its parts (NormedRow)
        gn_ptr,
        parts_ptr,
        HAS_BIAS: tl.constexpr,
        EPI: tl.constexpr,  # 0 stored, 1 pushed, 2 SwiGLU, 3 rotary + cache, 4 added into the output
        NEXT: tl.constexpr,  # EPI 4: and the sum left for the next RMSNorm (gemv.py `NormedRow`)
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
            if EPI == 4:  # added into the output in place (a projection's row into the residual stream)
                y += tl.load(out_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=n_ok)
            if NEXT:  # the sum (the next norm's input): times the norm's weight, and its part of the squares
                y = tl.where(n_ok, y.to(out_ptr.dtype.element_ty).to(tl.float32), 0.0)
                g = tl.load(gn_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
                tl.store(u_ptr + rn, (y * g).to(u_ptr.dtype.element_ty), mask=n_ok)
                tl.store(parts_ptr + pid, tl.sum(y * y, axis=0))
