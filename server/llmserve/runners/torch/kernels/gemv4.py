"""Batch-1 decode GEMV over 4-bit weights: y = x @ W.T (+ bias), W[n, k] = (q[n, k] - z[n, g]) * s[n, g], g = k // G.

A batch-1 step reads every weight once: its products are bound by how fast the weights stream, and 4-bit
weights carry twice the weights of int8's per byte, so converting them must cost few instructions. Operands
(`gemv4_operands`, made once at load from the canonical w4 of quant/__init__.py):

- `weight` int32 [N, K // 8]: word [n, w] holds q[n, 8w + j] in bits 4j .. 4j+3 (canonical qweight
  transposed): a thread reads 16 bytes = 32 consecutive weights of one row with one load;
- `sz` int32 [N, K // G]: per row and group, the scale's fp32 bits with the low 5 bits replaced by the
  integer zero point (0..31; the scale keeps 18 of its 23 mantissa bits: relative error < 2^-18).

Conversion, exact: nibble j stays where it is; OR-ing the exponent of 2^(23 - 4j) over it makes the float
2^(23 - 4j) + q (bit 4j is then worth 1), one logic op; minus (2^(23 - 4j) + z) gives q - z, one add; one
fma with x. Nibbles 5-7 are shifted down by 12 first (bit 23 is the exponent's). Per group, the sum of
(q - z) * x over a thread's weights takes the scale once.

A program owns BLOCK_N whole rows and walks K a GPT-group tile at a time: no split-K, no atomics, written
once, the same bits every run.
"""

from __future__ import annotations

import torch

from . import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _nibbles(w, zf, xj, J: tl.constexpr):
        """sum over the tile's words of (q_J - z) * x_J: nibble J of every word, as 2^(23 - 4 JJ) + q."""
        JJ: tl.constexpr = J if J < 5 else J - 3
        f = ((w & (0xF << (4 * JJ))) | ((150 - 4 * JJ) << 23)).to(tl.float32, bitcast=True)
        return (f - (zf + (1 << (23 - 4 * JJ)))[:, :, None]) * xj.to(tl.float32)[None, :, :]

    @triton.jit
    def _split8(x):
        """x [.., 8] -> its 8 slices along the last dimension, j = 0..7."""
        s = tl.reshape(x, (x.shape[0], x.shape[1], 2, 2, 2))
        c0, c1 = tl.split(s)
        b00, b01 = tl.split(c0)
        b10, b11 = tl.split(c1)
        x0, x4 = tl.split(b00)
        x2, x6 = tl.split(b01)
        x1, x5 = tl.split(b10)
        x3, x7 = tl.split(b11)
        return x0, x1, x2, x3, x4, x5, x6, x7

    @triton.jit
    def _load_group_tile(w_ptrs, sz_ptrs, n_ok, more, EVEN_N: tl.constexpr):
        """A tile's words [BLOCK_N, GPT, WG] and its groups' scale-and-zero words [BLOCK_N, GPT] (zeros past K)."""
        if EVEN_N:
            return tl.load(w_ptrs, mask=more), tl.load(sz_ptrs, mask=more)
        return tl.load(w_ptrs, mask=n_ok[:, None, None] & more, other=0), tl.load(
            sz_ptrs, mask=n_ok[:, None] & more, other=0
        )

    @triton.jit
    def _gemv4_kernel(
        x_ptr,  # [K] bf16 / fp16 / fp32
        w_ptr,  # int32 [N, K // 8]
        sz_ptr,  # int32 [N, K // G]
        b_ptr,  # [N] or unused
        out_ptr,  # [N]
        N,
        K,
        stride_wn,
        stride_szn,
        HAS_BIAS: tl.constexpr,
        EVEN_N: tl.constexpr,
        BLOCK_N: tl.constexpr,
        GPT: tl.constexpr,  # groups a tile (K // G a multiple of it)
        WG: tl.constexpr,  # words a group: G // 8
        PREFETCH: tl.constexpr,
        XF32: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        rg = tl.arange(0, GPT)
        rw = tl.arange(0, WG)
        rj = tl.arange(0, 8)
        w_ptrs = w_ptr + rn[:, None, None].to(tl.int64) * stride_wn + (rg[None, :, None] * WG + rw[None, None, :])
        sz_ptrs = sz_ptr + rn[:, None].to(tl.int64) * stride_szn + rg[None, :]
        x_ptrs = x_ptr + (rg[:, None, None] * (8 * WG) + rw[None, :, None] * 8 + rj[None, None, :])
        acc = tl.zeros((BLOCK_N, GPT, WG), dtype=tl.float32)
        step = GPT * WG * 8
        w_next, sz_next = _load_group_tile(w_ptrs, sz_ptrs, n_ok, True, EVEN_N)
        for k in range(0, K, step):
            if PREFETCH:  # the next tile's loads are in flight while this one is converted and multiplied
                w, sz = w_next, sz_next
                w_next, sz_next = _load_group_tile(w_ptrs + GPT * WG, sz_ptrs + GPT, n_ok, k + step < K, EVEN_N)
            else:
                w, sz = _load_group_tile(w_ptrs, sz_ptrs, n_ok, True, EVEN_N)
            zf = ((sz & 0x1F) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            s = (sz & ~0x1F).to(tl.float32, bitcast=True)
            xt = tl.load(x_ptrs)
            if XF32:  # to fp32 before the split (else each slice after it)
                xt = xt.to(tl.float32)
            x0, x1, x2, x3, x4, x5, x6, x7 = _split8(xt)
            wh = w >> 12
            t = _nibbles(w, zf, x0, 0)
            t += _nibbles(w, zf, x1, 1)
            t += _nibbles(w, zf, x2, 2)
            t += _nibbles(w, zf, x3, 3)
            t += _nibbles(w, zf, x4, 4)
            t += _nibbles(wh, zf, x5, 5)
            t += _nibbles(wh, zf, x6, 6)
            t += _nibbles(wh, zf, x7, 7)
            acc += t * s[:, :, None]
            w_ptrs += GPT * WG
            sz_ptrs += GPT
            x_ptrs += step
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=n_ok)


ZERO_BITS = 5  # the zero point's bits in `sz`


def gemv4_operands(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Canonical w4 (qweight int32 [K // 8, N], scales, zeros [K // G, N]) -> (weight [N, K // 8], sz [N, K // G])
    as `gemv4` reads them; None where a zero point is not an integer in 0..31 or a scale is not a positive
    normal float (the canonical kernels then run every product)."""
    z = zeros.float()
    s = scales.float()
    if not (torch.equal(z, z.round()) and bool((z >= 0).all()) and bool((z < 2**ZERO_BITS).all())):
        return None
    if not bool(((s > 0) & torch.isfinite(s) & (s >= torch.finfo(torch.float32).tiny)).all()):
        return None
    bits = s.contiguous().view(torch.int32) & ~(2**ZERO_BITS - 1) | z.to(torch.int32)
    return qweight.t().contiguous(), bits.t().contiguous()


def gemv4_scales(sz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) [N, K // G] fp32 as `gemv4` reads them from `sz`."""
    return (sz & ~(2**ZERO_BITS - 1)).view(torch.float32), (sz & (2**ZERO_BITS - 1)).float()


def gemv4_ref(
    x: torch.Tensor, weight: torch.Tensor, sz: torch.Tensor, bias: torch.Tensor | None = None, out_dtype=None
) -> torch.Tensor:
    """What `gemv4` computes, in fp32 from the dequantized weight (up to summation order)."""
    N, KW = weight.shape
    shifts = torch.arange(0, 32, 4, device=weight.device, dtype=torch.int32)
    q = ((weight[:, :, None] >> shifts) & 0xF).reshape(N, KW * 8).float()
    s, z = gemv4_scales(sz)
    G = KW * 8 // sz.shape[1]
    W = (q - z.repeat_interleave(G, 1)) * s.repeat_interleave(G, 1)
    y = x.float() @ W.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def gemv4_launch(N: int, K: int, G: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, GPT, num_warps, PREFETCH, XF32): 8 rows a program over 8 groups a tile (until a sweep says otherwise)."""
    gpt = 8
    while (K // G) % gpt:
        gpt //= 2
    return 8, gpt, 4, 0, 1


def gemv4_ok(x: torch.Tensor, weight: torch.Tensor, sz: torch.Tensor) -> bool:
    """Whether `gemv4` runs this product: one row on CUDA with Triton, and a group of 8..256 weights (a power of 2)."""
    if x.dim() != 2 or x.shape[0] != 1 or not use_triton(x):
        return False
    G = weight.shape[1] * 8 // sz.shape[1]
    return 8 <= G <= 256 and G & (G - 1) == 0 and G * sz.shape[1] == weight.shape[1] * 8


def gemv4(
    x: torch.Tensor,
    weight: torch.Tensor,
    sz: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [1, K] @ W.T (+ bias [N]) -> [1, N] in out_dtype (default x's), W from `gemv4_operands`' (weight, sz)."""
    N, KW = weight.shape
    K = KW * 8
    if x.shape != (1, K):
        raise ValueError(f"gemv4: x {tuple(x.shape)} is not one row of K={K}")
    G = K // sz.shape[1]
    block_n, gpt, warps, prefetch, xf32 = config or gemv4_launch(N, K, G)
    if (K // G) % gpt:
        raise ValueError(f"gemv4: {K // G} groups are not a multiple of {gpt} a tile")
    out = torch.empty(1, N, dtype=out_dtype or x.dtype, device=x.device)
    _gemv4_kernel[(triton.cdiv(N, block_n),)](
        x.contiguous(),
        weight,
        sz,
        bias if bias is not None else weight,
        out,
        N,
        K,
        weight.stride(0),
        sz.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_N=N % block_n == 0,
        BLOCK_N=block_n,
        GPT=gpt,
        WG=G // 8,
        PREFETCH=bool(prefetch),
        XF32=bool(xf32),
        num_warps=warps,
        num_stages=1,
    )
    return out
