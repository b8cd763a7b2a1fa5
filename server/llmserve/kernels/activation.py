"""SwiGLU: silu(gate) * up over the fused gate_up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.kernels import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _swiglu_kernel(x_ptr, out_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < n
        g = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + n + cols, mask=m, other=0.0).to(tl.float32)
        y = g * tl.sigmoid(g) * u
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def swiglu_ref(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(dtype or x.dtype)


def swiglu(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, 2n] (gate | up; bf16 or a wider fp32 projection output) -> [T, n] in `dtype` (default x's)."""
    if not use_triton(x):
        return swiglu_ref(x, dtype)
    n = x.shape[-1] // 2
    out = torch.empty(x.shape[0], n, dtype=dtype or x.dtype, device=x.device)
    block = 1024
    _swiglu_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block, num_warps=4)
    return out
