"""Prefill-sized weight-only GEMMs (M >= DEQUANT_M): dequantize the weight once into x's dtype, then cuBLAS.

At thousands of rows a step is bound by tensor-core throughput, not by reading the weight: one pass that
writes the weight in bf16 (a few percent of the GEMM's time at M = 2048) buys cuBLAS's GEMM, which beats a
kernel that must dequantize every tile inside its main loop (scripts/lab/bench_quant_gemm.py). Decode-sized M
stays with quant_gemm.py's kernels, which read only the quantized bytes.

Each weight is rounded once to x's dtype, as a dense bf16 weight would be, by a Triton kernel:
- w8: q * scale, W [N, K] from qweight [N, K]. (Converting q exactly and scaling the fp32 output instead
  costs a pass over the [M, N] output, more than the weight's at M = 2048: measured slower.)
- w4: (q - zero) * scale, W.T [K, N] from the packed words [K / 8, N] (cuBLAS takes either layout).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

DEQUANT_M = 1024  # from this many rows (measured on an H100: docs/quantization.md)

if triton is not None:

    @triton.jit
    def _w8_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (n[:, None] < N) & (k[None, :] < K)
        offs = n[:, None].to(tl.int64) * K + k[None, :]
        q = tl.load(w_ptr + offs, mask=mask, other=0).to(tl.float32)
        s = tl.load(s_ptr + n, mask=n < N, other=0.0)
        tl.store(out_ptr + offs, (q * s[:, None]).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _w4_dequant_kernel(
        w_ptr, s_ptr, z_ptr, out_ptr, N, R, stride_s, stride_z, G: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (r[:, None] < R) & (n[None, :] < N)
        words = tl.load(w_ptr + r[:, None].to(tl.int64) * N + n[None, :], mask=mask, other=0)
        for j in tl.static_range(8):
            k = r * 8 + j
            g = (k // G).to(tl.int64)
            s = tl.load(s_ptr + g[:, None] * stride_s + n[None, :], mask=mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g[:, None] * stride_z + n[None, :], mask=mask, other=0.0).to(tl.float32)
            q = ((words >> (4 * j)) & 0xF).to(tl.float32)
            w = (q - z) * s
            tl.store(out_ptr + k[:, None].to(tl.int64) * N + n[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def w8_dequant_mm(x, qweight, scale, bias, out_dtype) -> torch.Tensor:
    N, K = qweight.shape
    w = torch.empty(N, K, dtype=x.dtype, device=x.device)
    _w8_dequant_kernel[(triton.cdiv(N, 32), triton.cdiv(K, 256))](qweight, scale, w, N, K, BLOCK_N=32, BLOCK_K=256)
    out = torch.mm(x, w.t(), out_dtype=torch.float32)
    if bias is not None:
        out.add_(bias)
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def w4_dequant_mm(x, qweight, scales, zeros, G: int, bias, out_dtype) -> torch.Tensor:
    R, N = qweight.shape
    wt = torch.empty(R * 8, N, dtype=x.dtype, device=x.device)  # W.T
    grid = (triton.cdiv(R, 16), triton.cdiv(N, 128))
    _w4_dequant_kernel[grid](
        qweight, scales, zeros, wt, N, R, scales.stride(0), zeros.stride(0), G=G, BLOCK_R=16, BLOCK_N=128
    )
    out = torch.mm(x, wt, out_dtype=torch.float32)
    if bias is not None:
        out.add_(bias)
    return out if out_dtype == torch.float32 else out.to(out_dtype)
