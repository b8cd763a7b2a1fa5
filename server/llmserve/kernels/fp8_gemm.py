"""FP8 (E4M3) linear layers: y = x @ W.T (+ bias), W held in quant/__init__.py's canonical fp8 form.

`fp8_linear(x, weight, scale, block, bias, out_dtype)`: weight float8_e4m3fn [N, K]; scale fp32 [N]
(per output channel, block=None) or [ceil(N/B), ceil(K/B)] (B x B blocks, block=B, DeepSeek-V3's
128). `fp8_path(device)` names the path a device runs:

- "w8a8" (CUDA, sm_89+: FP8 tensor cores). The activations are quantized per token on the fly
  (fp8_quant.py's `quantize_act`: per row, or with block scales per 128-column group), then
    per channel: torch._scaled_mm with rowwise scales (x_scale [M, 1], scale [1, N]; cuBLASLt on
      sm_90 or CUTLASS, fp32 accumulation), where its constraints hold (K and N multiples of 16,
      W contiguous, 16-byte aligned operands) and a one-time probe found it working for the output
      dtype; otherwise the Triton GEMM below with one scale per row and column;
    block scales: a Triton GEMM on float8e4nv operands; each 128-deep K step's tl.dot (fp32
      accumulate) is scaled by x_scale[m, kb] * w_scale[n // 128, kb] and added to an fp32
      accumulator, so the tensor cores' limited fp8 accumulation spans 128 products at most
      (DeepSeek-V3's promotion interval).
- "weight_only" (CUDA before sm_89). Triton 3.6 has no float8e4nv type below sm_89 (neither loads
  nor conversions compile), so the kernel loads the weight's bytes as uint8 and decodes E4M3 by bit
  manipulation: (sign << 15) | (exponent-mantissa << 7) is, as fp16 bits, the E4M3 value times 2^-8
  (subnormals included, exactly; the 2^8 is folded into the scale). The tile, converted to the
  activation dtype (exact: 4 significant bits), goes through tl.dot with the bf16/fp16 activation
  (fp32 activations: TF32); the scale multiplies the fp32 product per column (per K block for block
  scales) instead of every weight element: the same W, fewer roundings and multiplies.
- "ref" (CPU): `fp8_linear_ref`, W dequantized exactly to fp32, then a fp32 matmul.

On the "w8a8" path a product of one row (batch-1 decode) goes to `kernels/gemv.py` instead: a CUDA-core
GEMV that streams the FP8 weight at about its memory floor and keeps x unquantized (the tensor-core
path pads the row to a tile and quantizes it first).

Under TRITON_INTERPRET=1 (tests) a CPU device takes "w8a8" with the Triton GEMM for both scale
kinds. Nothing here syncs with the host or allocates by data: the calls are CUDA-graph safe once
warmed up (the probe of torch._scaled_mm runs on a first call outside a capture; a first call during
one takes the Triton GEMM without deciding).

Micro-benchmark (a GPU; bf16 mm vs fp8_linear): PYTHONPATH=server python scripts/lab/bench_fp8_gemm.py
"""

from __future__ import annotations

import os

import torch

from llmserve.kernels import HAS_TRITON, switches
from llmserve.kernels.fp8_quant import FP8_MAX, _cdiv, dequantize_act_ref, quantize_act, quantize_act_ref
from llmserve.kernels.gemv import gemv, gemv_ok

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Program -> (tile row, tile column), GROUP_M tile rows at a time (the weight tiles stay in L2)."""
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        in_group = GROUP_M * num_n
        first_m = (pid // in_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m

    @triton.jit
    def _w8a8_gemm_kernel(
        a_ptr,
        as_ptr,
        b_ptr,
        bs_ptr,
        bias_ptr,
        c_ptr,
        M,
        N,
        K,
        stride_am,
        stride_ak,
        stride_asm,
        stride_bn,
        stride_bk,
        stride_bsn,
        stride_cm,
        SCALE_BLOCK: tl.constexpr,
        PER_CHANNEL: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """C = (A * a_scale) @ (B * b_scale).T, A [M, K] and B [N, K] E4M3. Per channel: a_scale [M]
        (stride_asm), b_scale [N]. Blocks: a_scale [M, K / SCALE_BLOCK], b_scale [N / SCALE_BLOCK,
        K / SCALE_BLOCK] (row stride stride_bsn); BLOCK_K divides SCALE_BLOCK."""
        pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        mask_n = offs_n < N
        a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None] * stride_bk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask_k = offs_k < K - k0
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            part = tl.dot(a, b)  # fp32, a fresh accumulator each step: promoted every BLOCK_K products
            if PER_CHANNEL:
                acc += part
            else:
                kb = k0 // SCALE_BLOCK
                sa = tl.load(as_ptr + offs_m * stride_asm + kb, mask=mask_m, other=0.0)
                sb = tl.load(bs_ptr + (offs_n // SCALE_BLOCK) * stride_bsn + kb, mask=mask_n, other=0.0)
                acc += part * sa[:, None] * sb[None, :]
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if PER_CHANNEL:
            sa = tl.load(as_ptr + offs_m * stride_asm, mask=mask_m, other=0.0)
            sb = tl.load(bs_ptr + offs_n, mask=mask_n, other=0.0)
            acc = acc * sa[:, None] * sb[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def _w8a16_gemm_kernel(
        a_ptr,
        b_ptr,
        bs_ptr,
        bias_ptr,
        c_ptr,
        M,
        N,
        K,
        stride_am,
        stride_ak,
        stride_bn,
        stride_bk,
        stride_bsn,
        stride_cm,
        SCALE_BLOCK: tl.constexpr,
        PER_CHANNEL: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """C = A @ (B * b_scale).T, A [M, K] bf16/fp16/fp32, B [N, K] the E4M3 bytes (uint8)."""
        pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        mask_n = offs_n < N
        a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None] * stride_bk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask_k = offs_k < K - k0
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            u = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0).to(tl.int32)
            bits = ((u & 0x80) << 8) | ((u & 0x7F) << 7)  # E4M3 -> fp16 bits of value * 2^-8
            w = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(a.dtype)
            if PER_CHANNEL:
                acc = tl.dot(a, w, acc)
            else:
                kb = k0 // SCALE_BLOCK
                sb = tl.load(bs_ptr + (offs_n // SCALE_BLOCK) * stride_bsn + kb, mask=mask_n, other=0.0)
                acc += tl.dot(a, w) * (sb * 256.0)[None, :]
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if PER_CHANNEL:
            acc = acc * (tl.load(bs_ptr + offs_n, mask=mask_n, other=0.0) * 256.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# ---- the references ----


def fp8_dequant_ref(weight: torch.Tensor, scale: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """W [N, K] fp32 from the canonical form (exact up to fp32's rounding of weight * scale)."""
    N, K = weight.shape
    w = weight.float()
    if block is None:
        return w * scale.float().reshape(N, 1)
    s = scale.float().repeat_interleave(block, 0)[:N].repeat_interleave(block, 1)[:, :K]
    return w * s


def fp8_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: int | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    quantize_x: bool = False,
) -> torch.Tensor:
    """x @ W.T (+ bias) in fp32, W dequantized exactly; quantize_x=True first rounds x per token as
    the w8a8 path does (per 128-column group with block scales), quantize_x=False keeps x as it is
    (what the weight-only path computes)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if quantize_x:
        xq, xs = quantize_act_ref(x2, block)
        xf = dequantize_act_ref(xq, xs, block)
    else:
        xf = x2.float()
    y = xf @ fp8_dequant_ref(weight, scale, block).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype).reshape(*lead, weight.shape[0])


# ---- dispatch ----

_CAPABILITY: dict[int, tuple[int, int]] = {}
_SCALED_MM_OK: dict[tuple[int, torch.dtype], bool] = {}


def _capability(device: torch.device) -> tuple[int, int]:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    return _CAPABILITY[idx]


def fp8_path(device: torch.device | str) -> str:
    """The path fp8_linear runs on `device`: "w8a8", "weight_only" or "ref" (module doc)."""
    device = torch.device(device)
    if not HAS_TRITON or switches.current.ref:
        return "ref"
    if device.type == "cuda":
        return "w8a8" if _capability(device) >= (8, 9) else "weight_only"
    return "w8a8" if os.environ.get("TRITON_INTERPRET") == "1" else "ref"


def _scaled_mm_ok(device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm runs rowwise-scaled E4M3 GEMMs into `out_dtype` here, and right:
    decided once per (device, dtype) by a small product against the reference."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (idx, out_dtype)
    ok = _SCALED_MM_OK.get(key)
    if ok is not None:
        return ok
    if not hasattr(torch, "_scaled_mm"):
        ok = False
    elif torch.cuda.is_current_stream_capturing():
        return False  # no probe inside a capture: the Triton GEMM this once
    else:
        g = torch.Generator().manual_seed(0)
        a = (torch.randn(5, 64, generator=g) * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        b = (torch.randn(48, 64, generator=g) * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        sa = torch.rand(5, 1, generator=g) + 0.5
        sb = torch.rand(1, 48, generator=g) + 0.5
        ref = (a.float() * sa) @ (b.float() * sb.t()).t()
        try:
            d = device
            y = torch._scaled_mm(a.to(d), b.to(d).t(), scale_a=sa.to(d), scale_b=sb.to(d), out_dtype=out_dtype).float()
            ok = y.shape == ref.shape and bool(((y.cpu() - ref).abs() <= 1e-2 * ref.abs().max()).all())
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            ok = False
    _SCALED_MM_OK[key] = ok
    return ok


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int | None) -> None:
    N, K = weight.shape
    if x.shape[-1] != K or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} {weight.dtype}")
    want = (N,) if block is None else (_cdiv(N, block), _cdiv(K, block))
    if tuple(scale.shape) != want:
        raise ValueError(f"fp8_linear: scale {tuple(scale.shape)} for weight {(N, K)}, block {block}: want {want}")


def _aligned(*ts: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in ts)


# ---- the Triton launches (also reached directly by the tests) ----


def _w8a8_config(M: int, N: int) -> dict:
    # Decode (M <= 16) is weight-bandwidth bound: narrow tiles give enough programs, deep pipelines keep
    # loads in flight. (Triton 3.6 on sm_90 runs a 16-row tile's dot as mma.sync on fp16, the E4M3
    # operands converted exactly in registers; 64+ rows use wgmma on E4M3.)
    if M <= 16:
        return dict(BLOCK_M=16, BLOCK_N=32 if N <= 16384 else 64, GROUP_M=1, num_warps=4, num_stages=5)
    if M <= 32:
        return dict(BLOCK_M=32, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4)
    if M <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3)


def w8a8_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: int | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The Triton w8a8 GEMM: x_scale [M, 1] with per-channel scale [N], [M, ceil(K/B)] with blocks."""
    M, K = x_fp8.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=out_dtype, device=x_fp8.device)
    cfg = _w8a8_config(M, N)
    block_k = 128 if block is None else min(128, block)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _w8a8_gemm_kernel[grid](
        x_fp8,
        x_scale,
        weight,
        scale,
        bias if bias is not None else scale,
        out,
        M,
        N,
        K,
        x_fp8.stride(0),
        x_fp8.stride(1),
        x_scale.stride(0),
        weight.stride(0),
        weight.stride(1),
        scale.stride(0),
        out.stride(0),
        SCALE_BLOCK=block or 128,
        PER_CHANNEL=block is None,
        HAS_BIAS=bias is not None,
        BLOCK_K=block_k,
        **cfg,
    )
    return out


def _weight_only_config(M: int, cap: tuple[int, int]) -> dict:
    stages = 3 if cap >= (8, 0) else 2
    if M <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=stages + 1)
    if M <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=stages)
    return dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=stages)


def weight_only_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: int | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The Triton weight-only GEMM (E4M3 decoded from its bytes; any CUDA arch Triton supports)."""
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    cap = _capability(x.device) if x.is_cuda else (9, 0)
    cfg = _weight_only_config(M, cap)
    w = weight.view(torch.uint8)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _w8a16_gemm_kernel[grid](
        x,
        w,
        scale,
        bias if bias is not None else scale,
        out,
        M,
        N,
        K,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        scale.stride(0),
        out.stride(0),
        SCALE_BLOCK=block or 128,
        PER_CHANNEL=block is None,
        HAS_BIAS=bias is not None,
        BLOCK_K=64 if block is None else min(64, block),
        **cfg,
    )
    return out


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: int | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) -> [..., N] in out_dtype (default x's), W = weight * scale (module doc)."""
    _check(x, weight, scale, block)
    out_dtype = out_dtype or x.dtype
    path = fp8_path(x.device)
    if path == "ref" or (block is not None and (block < 16 or block & (block - 1))):
        return fp8_linear_ref(x, weight, scale, block, bias, out_dtype)
    lead, K = x.shape[:-1], x.shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 0:
        return torch.zeros(*lead, N, dtype=out_dtype, device=x.device)
    if path == "weight_only":
        y = weight_only_gemm(x2, weight, scale, block, bias, out_dtype)
        return y.reshape(*lead, N)
    if gemv_ok(x2, weight, block or 0):  # batch-1 decode: kernels/gemv.py, x unquantized
        return gemv(x2, weight, scale, block or 0, bias, out_dtype).reshape(*lead, N)
    xq, xs = quantize_act(x2, block)
    if (
        block is None
        and x2.is_cuda
        and K % 16 == 0
        and N % 16 == 0
        and weight.is_contiguous()
        and scale.is_contiguous()
        and scale.dtype == torch.float32
        and _aligned(weight, scale)
        and _scaled_mm_ok(x2.device, out_dtype)
    ):
        # Bias: _scaled_mm takes one only of the output's 16-bit dtype (none with fp32 output).
        fuse = bias is not None and bias.dtype == out_dtype and out_dtype in (torch.bfloat16, torch.float16)
        y = torch._scaled_mm(
            xq, weight.t(), scale_a=xs, scale_b=scale.view(1, N), bias=bias if fuse else None, out_dtype=out_dtype
        )
        if bias is not None and not fuse:
            y += bias
        return y.reshape(*lead, N)
    y = w8a8_gemm(xq, xs, weight, scale, block, bias, out_dtype)
    return y.reshape(*lead, N)
