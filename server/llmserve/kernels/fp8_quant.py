"""Per-token FP8 (E4M3) activation quantization: the first step of kernels/fp8_gemm.py's w8a8 path.

`quantize_act(x, group)`: x [M, K] -> (x_fp8 float8_e4m3fn [M, K], x_scale fp32 [M, G]). A row's
(group=None, G = 1), or a row's `group`-column group's (G = ceil(K / group); 128 with block scales),
absmax / 448 is its fp32 scale; x * (448 / absmax) rounds to E4M3, ties to even. The absmax is at
least AMAX_EPS, so a zero row/group quantizes to zeros with a finite scale. `quantize_act_ref` is the
torch reference (the CPU path) and computes the Triton kernel's bits exactly (IEEE fp32 division and
multiplication in both; under TRITON_INTERPRET=1 the kernel rounds by arithmetic, `_rne_e4m3`, as the
interpreter's own fp8 cast rounds ties away). `dequantize_act_ref` maps back to fp32. The kernel
neither syncs with the host nor allocates by data: CUDA-graph safe.
"""

from __future__ import annotations

import torch

from llmserve.kernels import next_pow2, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

FP8_MAX = 448.0  # largest finite E4M3 (float8_e4m3fn) value
AMAX_EPS = 1e-12  # a zero row/group quantizes to zeros with scale AMAX_EPS / 448, never 0 / 0

if triton is not None:

    @triton.jit
    def _rne_e4m3(v):
        """The E4M3 value nearest to v (|v| <= 448), ties to even, computed exactly in fp32.

        The interpreter's fp32 -> fp8 cast rounds ties away and drops the mantissa's carry (Triton
        3.6); a value already on the E4M3 grid converts exactly there, as on a GPU."""
        bits = v.to(tl.int32, bitcast=True)
        a = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127  # floor(log2 a); -127 for 0
        e = tl.maximum(e, -6)  # below 2^-6: E4M3 subnormals, one grid step 2^-9
        ulp = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
        t = a * ((130 - e) << 23).to(tl.float32, bitcast=True)  # a / ulp, exact: in [0, 16)
        f = tl.floor(t)
        r = t - f
        odd = (f.to(tl.int32) & 1) == 1
        up = (r > 0.5) | ((r == 0.5) & odd)
        q = (f + up.to(tl.float32)) * ulp
        return (q.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)  # v's sign

    @triton.jit
    def _quant_act_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        stride_x,
        stride_q,
        stride_s,
        K,
        GSIZE,
        NG: tl.constexpr,
        GBLOCK: tl.constexpr,
        SOFT_ROUND: tl.constexpr,
    ):
        """Row `program_id(0)`, groups NG * program_id(1) .. + NG of GSIZE columns (GBLOCK >= GSIZE)."""
        row = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1) * NG + tl.arange(0, NG)
        j = tl.arange(0, GBLOCK)
        cols = g[:, None] * GSIZE + j[None, :]
        m = (j[None, :] < GSIZE) & (cols < K)
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12)  # AMAX_EPS
        inv = tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)  # IEEE, as torch divides
        v = tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0)
        if SOFT_ROUND:
            v = _rne_e4m3(v)
        tl.store(q_ptr + row * stride_q + cols, v.to(tl.float8e4nv), mask=m)
        scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
        tl.store(s_ptr + row * stride_s + g, scale, mask=g * GSIZE < K)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_act_ref(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token E4M3 quantization of x [M, K]: (x_fp8 [M, K], x_scale fp32 [M, G]), G = 1 (group=None:
    the whole row) or ceil(K / group). amax = max(|x| over the group, 1e-12); x_scale = amax / 448;
    x_fp8 = E4M3(clamp(x * (448 / amax), +-448)), round to nearest, ties to even (IEEE fp32 division
    and multiplication: the Triton kernel computes the same bits). x ~= x_fp8 * x_scale, within
    2^-4 of |x| (3 mantissa bits) for |x| >= 2^-6 * x_scale, and within 2^-10 * x_scale below."""
    M, K = x.shape
    gs = K if group is None else group
    G = _cdiv(K, gs) if K else 1
    xf = torch.nn.functional.pad(x.float(), (0, G * gs - K)).view(M, G, gs)
    amax = xf.abs().amax(dim=2).clamp_min(AMAX_EPS)
    inv = torch.div(torch.full_like(amax, FP8_MAX), amax)  # not 448 / t: torch would take 1 / t * 448
    q = (xf * inv[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scale = torch.div(amax, torch.full_like(amax, FP8_MAX))
    return q.view(M, G * gs)[:, :K].contiguous(), scale


def dequantize_act_ref(x_fp8: torch.Tensor, x_scale: torch.Tensor, group: int | None = None) -> torch.Tensor:
    K = x_fp8.shape[1]
    s = x_scale if group is None else x_scale.repeat_interleave(group, 1)[:, :K]
    return x_fp8.float() * s


def quantize_act(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_act_ref's result, by the Triton kernel where kernels run (bit for bit the same)."""
    if not use_triton(x):
        return quantize_act_ref(x, group)
    M, K = x.shape
    G = 1 if group is None else _cdiv(K, group)
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, G, dtype=torch.float32, device=x.device)
    if M == 0:
        return q, s
    if group is None:
        gs, gblock, ng = K, next_pow2(K), 1
        warps = min(16, max(1, gblock // 512))
    else:
        gs, gblock = group, next_pow2(group)
        ng = max(1, min(next_pow2(G), 2048 // gblock))
        warps = min(8, max(1, ng * gblock // 512))
    _quant_act_kernel[(M, triton.cdiv(G, ng))](
        x,
        q,
        s,
        x.stride(0),
        q.stride(0),
        s.stride(0),
        K,
        gs,
        NG=ng,
        GBLOCK=gblock,
        SOFT_ROUND=not x.is_cuda,
        num_warps=warps,
    )
    return q, s
