"""Products of 2-16 rows over bf16/fp16 weights on the tensor cores, each weight read once: y = x @ W.T (+ bias).

A speculative verification step (k proposals + 1 row a sequence) or a small decode batch multiplies a few
rows by every weight of the model: like batch 1, it is bound by how fast the weights stream. On an H100,
an 8B step's products at 5 rows take 5.39 ms here against cuBLAS's 5.66 and the one-row GEMV's 4.67
(kernels/gemv.py; docs/speculative.md, run 116); a CUDA-core GEMV for several rows was slower still (its
FMAs grow with the rows).

Here the weight is the MMA's tall operand: a program owns BLOCK_N weight rows and all of K, and multiplies
each [BLOCK_N, BLOCK_K] weight tile by x's [BLOCK_K, BLOCK_M] (the rows padded to BLOCK_M = 16, the pad
masked to zeros) with `tl.dot`, the weight tiles pipelined through shared memory (num_stages). No split-K:
no atomics, no zeroed output and no second kernel; the result is written once, in the output dtype, and is
the same run to run. x's few rows are re-read by every program, from L2.

As the one-row GEMV's, its epilogue can also do what follows the product (gemv_epilogue.py's row pairs): gate_up's
SwiGLU, and qkv's rotary embedding with each row's k and v written into the cache at its own slot, with the separate
kernels' bits and two launches a layer fewer. Launched with PDL (pdl.py), a program asks L2 for its first tiles
(the pipeline's depth) before it waits for the kernel before, and lets the next one launch after its main loop.
They take 0.15 ms off the device time of an 8B k = 4 verification step on an H100 (5.95 -> 5.81 ms without PDL); what
that step costs against a plain one also depends on the host's serial share, which differs from box to box
(docs/speculative.md, runs 138-145).
"""

from __future__ import annotations

import torch

from llmserve.kernels import switches, use_triton
from llmserve.kernels.gemv import RopeCache, rope_operands
from llmserve.kernels.pdl import launch_args, pdl_on

try:
    import triton
    import triton.language as tl

    from llmserve.kernels.gemv_epilogue import gemv_rows
    from llmserve.kernels.pdl import l2_prefetch, pdl_launch_next, pdl_wait
    from llmserve.kernels.rotary import rope_pairs
except ImportError:  # pragma: no cover
    triton = None

SKINNY_MAX_M = 16  # products of 2..SKINNY_MAX_M rows of unquantized weights run here on CUDA (the `skinny` switch)

if triton is not None:

    @triton.jit
    def _skinny_kernel(
        x_ptr,  # [M, K], K contiguous
        w_ptr,  # [N, K] bf16 / fp16, K contiguous (EPI 2: [2N, K])
        b_ptr,  # [N] or unused
        out_ptr,  # [M, N], N contiguous
        M,
        N,  # output columns (EPI 2: half the weight's rows)
        K,
        stride_xm,
        stride_wn,
        stride_om,
        pos_ptr,  # EPI 3: each row's position and cache slot, cos/sin, the layer's caches (gemv.RopeCache)
        slot_ptr,
        cs_ptr,
        k_cache_ptr,
        v_cache_ptr,
        stride_cb,
        stride_ch,
        num_heads,
        num_kv_heads,
        HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EPI: tl.constexpr,  # what becomes of the rows: 0 stored, 2 SwiGLU, 3 rotary + cache (gemv_epilogue.py)
        HALF: tl.constexpr,  # EPI 3: half the head dim
        CACHE_BLOCK: tl.constexpr,
        LIMIT: tl.constexpr,
        PDL: tl.constexpr,  # launched with PDL (pdl.py)
        PREFETCH: tl.constexpr,  # PDL: weight tiles a row asked of L2 before the wait (the pipeline's depth)
    ):
        pid = tl.program_id(0)
        rn, n_ok = gemv_rows(pid, N, BLOCK_N, EPI, HALF)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        # The last program's rows past N read row 0 (unmasked loads pipeline best); never stored
        w_rows = w_ptr + tl.where(n_ok, rn, 0)[:, None].to(tl.int64) * stride_wn
        w_ptrs = w_rows + rk[None, :]
        x_ptrs = x_ptr + rm[None, :] * stride_xm + rk[:, None]  # x.T's tile: [BLOCK_K, BLOCK_M]
        if PDL:  # the first tiles the pipeline will copy, asked of L2 before the wait (weights: no kernel's output)
            lines = tl.minimum(tl.arange(0, PREFETCH * BLOCK_K // 64) * 64, K - 1)  # one a 128-byte line
            l2_prefetch(w_rows + lines[None, :])
        pdl_wait(PDL)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            else:
                k_ok = (k + rk) < K
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                xt = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(w, xt.to(w.dtype), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        pdl_launch_next(PDL)
        if EPI == 0:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            out_ptrs = out_ptr + rm[None, :] * stride_om + rn[:, None]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])
        else:  # the program's rows in pairs (gemv_rows): gate j and up j; a head's j and j + HALF
            a, b = tl.split(tl.permute(tl.reshape(acc, (BLOCK_N // 2, 2, BLOCK_M)), (0, 2, 1)))
            r1 = tl.split(tl.reshape(rn, (BLOCK_N // 2, 2)))[0]
            if EPI == 2:  # silu(gate) * up, as kernels/activation.py computes it from the fp32 rows
                ro = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
                out_ptrs = out_ptr + rm[None, :] * stride_om + ro[:, None]
                tl.store(out_ptrs, (a * tl.sigmoid(a) * b).to(out_ptr.dtype.element_ty), mask=m_ok[None, :] & (ro < N)[:, None])  # fmt: skip
            else:  # kernels/rotary.py's rotation and cache write, each row at its own position and slot
                pos = tl.load(pos_ptr + rm, mask=m_ok, other=0).to(tl.int64)[None, :]
                slot = tl.load(slot_ptr + rm, mask=m_ok, other=-1).to(tl.int64)[None, :]
                rope_pairs(
                    a, b, r1[:, None], (r1 < N)[:, None] & m_ok[None, :], out_ptr + rm[None, :] * stride_om, pos,
                    slot, cs_ptr, k_cache_ptr, v_cache_ptr, stride_cb, stride_ch, num_heads, num_kv_heads, HALF,
                    CACHE_BLOCK, LIMIT,
                )  # fmt: skip


def skinny_launch(N: int, K: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for N weight rows of K, from sweeps on an H100 and an H200 (5 rows,
    the 8B shape's projections and LM head; scripts/lab/sweep_skinny.py): 64 x 128 tiles, 5 deep, the fastest or within
    1% on each but down (K = 14336), where 32 x 256 tiles were 3% faster. Bulk (TMA) copies of the weight tiles
    gained at most 1% in the same sweep (not kept)."""
    return (32, 256, 4, 5) if K > 8192 else (64, 128, 4, 5)


def skinny_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny` runs this product (the `skinny` switch on): 2..SKINNY_MAX_M rows on CUDA with Triton, a bf16/fp16 weight in
    x's dtype with K contiguous."""
    return (
        x.dim() == 2
        and switches.current.skinny
        and 2 <= x.shape[0] <= SKINNY_MAX_M
        and x.dtype == weight.dtype
        and weight.dtype in (torch.bfloat16, torch.float16)
        and weight.stride(1) == 1
        and use_triton(x)
    )


def skinny(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: tuple[int, int, int, int] | None = None,
    glu: bool = False,
    rope: RopeCache | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= 16) @ weight [N, K].T (+ bias [N]) -> [M, N] in out_dtype (default x's), accumulated in
    fp32. config: (BLOCK_N, BLOCK_K, num_warps, num_stages), for the sweep (default: skinny_launch). At most one
    of (no bias), as kernels/gemv.py's for one row, each row a token of its own:
    glu: the weight is a gate | up projection [2n, K], and the result is silu(gate) * up [M, n] in out_dtype;
    rope: the weight is a qkv projection, and the result is what `rope_and_cache` leaves of it (q rotated),
      each token's rotated k and v written into the cache at its slot.
    glu and rope compute from the same fp32 rows as the product alone, then as the separate kernel does."""
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K or not 1 <= M <= 16:
        raise ValueError(f"skinny: x {tuple(x.shape)} against weight {tuple(weight.shape)} (1 to 16 rows of K)")
    block_n, block_k, warps, stages = config or skinny_launch(N, K)
    epi = 2 if glu else 3 if rope is not None else 0
    if epi and (glu and rope is not None or bias is not None or N % 2 or block_n % 2):
        raise ValueError("skinny: glu or rope, without a bias, over pairs of rows (an even N)")
    rope_args, half, cache_block, limit = rope_operands(rope, N, weight)
    if rope is not None and rope.positions.shape[0] != M:
        raise ValueError(f"skinny: {M} rows against {rope.positions.shape[0]} positions")
    x = x.contiguous()
    n_out = N // 2 if glu else N
    out = torch.empty(M, n_out, dtype=out_dtype or x.dtype, device=x.device)
    count, per_program = (N // 2, block_n // 2) if epi else (N, block_n)  # outputs (glu), pairs (rope) or rows
    _skinny_kernel[(triton.cdiv(count, per_program),)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        M,
        n_out,
        K,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        *rope_args,
        HAS_BIAS=bias is not None,
        EVEN_K=K % block_k == 0,
        BLOCK_M=16,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EPI=epi,
        HALF=half,
        CACHE_BLOCK=cache_block,
        LIMIT=limit,
        PDL=(pdl := pdl_on(x)),
        PREFETCH=max(stages - 1, 1),
        num_warps=warps,
        num_stages=stages,
        **launch_args(pdl),
    )
    return out
