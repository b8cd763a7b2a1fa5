"""RMSNorm, optionally fused with the residual add that precedes it.

`rms_norm(x, w, eps, residual)`: with a residual, `residual += x` happens in
place (in the residual's dtype: the model keeps the residual stream in fp32)
and the norm is taken of the sum; one pass over the row instead of three.
The output has the weight's dtype (x may be a wider fp32 projection output).
"""

from __future__ import annotations

import torch

from llmserve.kernels import next_pow2, use_triton
from llmserve.kernels.pdl import launch_args, pdl_on

try:
    import triton
    import triton.language as tl

    from llmserve.kernels.pdl import pdl_launch_next, pdl_wait
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        stride_x,
        stride_r,
        stride_o,
        n,
        eps,
        HAS_RES: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,  # launched with PDL (pdl.py)
    ):
        pdl_wait(PDL)
        pdl_launch_next(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            s = x + tl.load(res_ptr + row * stride_r + cols, mask=m, other=0.0).to(tl.float32)
            s = s.to(res_ptr.dtype.element_ty)
            tl.store(res_ptr + row * stride_r + cols, s, mask=m)
            x = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        y = x * rstd * w  # one rounding, at the store (HF rounds x * rstd first, then the product)
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    dtype = w.dtype
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (w.float() * y).to(dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    if not use_triton(x):
        return rms_norm_ref(x, w, eps, residual)
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=w.dtype, device=x.device)
    block = next_pow2(n)
    res = residual if residual is not None else x
    _rms_norm_kernel[(x.shape[0],)](
        x,
        res,
        w,
        out,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        n,
        eps,
        HAS_RES=residual is not None,
        BLOCK=block,
        PDL=(pdl := pdl_on(x)),
        num_warps=min(16, max(1, block // 256)),
        **launch_args(pdl),
    )
    return out
