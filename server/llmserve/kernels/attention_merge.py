"""The split-KV merge of kernels/attention.py: a decode batch with few sequences splits each context over several
programs, each leaving its partial output and log-sum-exp; one program per (token, head) weights the partials by
their share of the softmax's total and sums them."""

from __future__ import annotations

import torch

from llmserve.kernels import next_pow2
from llmserve.kernels.pdl import launch_args

try:
    import triton
    import triton.language as tl

    from llmserve.kernels.pdl import pdl_launch_next, pdl_wait
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit(do_not_specialize=["num_splits", "stride_pt", "stride_lt"])
    def _merge_kernel(
        po_ptr,
        pl_ptr,
        out_ptr,
        num_heads,
        num_splits,
        stride_ps,
        stride_pt,
        stride_ls,
        stride_lt,
        stride_ot,
        stride_oh,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        S_PAD: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_wait(PDL)
        pdl_launch_next(PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        s = tl.arange(0, S_PAD)
        s_ok = s < num_splits
        lse = tl.load(pl_ptr + s * stride_ls + t * stride_lt + h, mask=s_ok, other=float("-inf"))
        mx = tl.max(lse, axis=0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w = tl.exp2(lse - mx)
        w = w / tl.maximum(tl.sum(w, axis=0), 1e-30)
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        po = tl.load(
            po_ptr + s[:, None] * stride_ps + t * stride_pt + h * HEAD_DIM + d[None, :],
            mask=s_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        o = tl.sum(po * w[:, None], axis=0)
        tl.store(out_ptr + t * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def merge_splits(po: torch.Tensor, pl: torch.Tensor, out: torch.Tensor, pdl: bool) -> None:
    """po [S, T, H, D] fp32 partial outputs and pl [S, T, H] their log2-sum-exp -> out [T, H, D] (its dtype)."""
    S, T, H, D = po.shape
    _merge_kernel[(T, H)](
        po,
        pl,
        out,
        H,
        S,
        po.stride(0),
        po.stride(1),
        pl.stride(0),
        pl.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=D,
        D_PAD=max(16, next_pow2(D)),
        S_PAD=max(2, next_pow2(S)),
        PDL=pdl,
        num_warps=4,
        **launch_args(pdl),
    )
