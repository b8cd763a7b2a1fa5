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
"""

from __future__ import annotations

import torch

from llmserve.config import Config

from . import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# Products of 2..SKINNY_MAX_M rows of unquantized weights run here on CUDA (LLMSERVE_SKINNY; read at import)
SKINNY_MAX_M = 16 if Config.read("skinny") else 0

if triton is not None:

    @triton.jit
    def _skinny_kernel(
        x_ptr,  # [M, K], K contiguous
        w_ptr,  # [N, K] bf16 / fp16, K contiguous
        b_ptr,  # [N] or unused
        out_ptr,  # [M, N], N contiguous
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_om,
        HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        # The last program's rows past N read row N - 1 again (unmasked loads pipeline best); never stored
        w_ptrs = w_ptr + (rn % N)[:, None].to(tl.int64) * stride_wn + rk[None, :]
        x_ptrs = x_ptr + rm[None, :] * stride_xm + rk[:, None]  # x.T's tile: [BLOCK_K, BLOCK_M]
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
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + rm[None, :] * stride_om + rn[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[None, :] & (rn < N)[:, None])


def skinny_launch(N: int, K: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for N weight rows of K, from sweeps on an H100 and an H200 (5 rows,
    the 8B shape's projections and LM head; scripts/sweep_skinny.py): 64 x 128 tiles, 5 deep, the fastest or within
    1% on each but down (K = 14336), where 32 x 256 tiles were 3% faster. Bulk (TMA) copies of the weight tiles
    gained at most 1% in the same sweep (not kept)."""
    return (32, 256, 4, 5) if K > 8192 else (64, 128, 4, 5)


def skinny_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny` runs this product: 2..SKINNY_MAX_M rows on CUDA with Triton, a bf16/fp16 weight in
    x's dtype with K contiguous."""
    return (
        x.dim() == 2
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
) -> torch.Tensor:
    """x [M, K] (M <= 16) @ weight [N, K].T (+ bias [N]) -> [M, N] in out_dtype (default x's), accumulated in
    fp32. config: (BLOCK_N, BLOCK_K, num_warps, num_stages), for the sweep (default: skinny_launch)."""
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K or not 1 <= M <= 16:
        raise ValueError(f"skinny: x {tuple(x.shape)} against weight {tuple(weight.shape)} (1 to 16 rows of K)")
    block_n, block_k, warps, stages = config or skinny_launch(N, K)
    x = x.contiguous()
    out = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    _skinny_kernel[(triton.cdiv(N, block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        M,
        N,
        K,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=K % block_k == 0,
        BLOCK_M=16,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out
