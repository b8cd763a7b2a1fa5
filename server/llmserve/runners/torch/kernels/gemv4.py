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
    def _nibble(w, xj, J: tl.constexpr, BIASED: tl.constexpr):
        """q_J * x_J for every word of the tile: nibble J in place, as the float M + q with M = 2^(23 - 4 JJ), less M;
        or, BIASED, (M + q) * x_J, whose M * x_J the caller takes off once for all rows (M <= 2^11 there: the sum
        of a row's terms then keeps >= 13 bits of q * x)."""
        JJ: tl.constexpr = J if J < 5 else J - 3
        f = ((w & (0xF << (4 * JJ))) | ((150 - 4 * JJ) << 23)).to(tl.float32, bitcast=True)
        if BIASED:
            return f * xj[:, :, None]
        return (f - (1 << (23 - 4 * JJ))) * xj[:, :, None]

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
    def _gemv4_kernel(
        x_ptr,  # [K] bf16 / fp16 / fp32
        w_ptr,  # int32 [N, K // 8], each group's words scattered (gemv4_operands)
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
        SCATTER: tl.constexpr,
        BIASED: tl.constexpr,
    ):
        # Tiles are [WG, GPT, BLOCK_N]: a thread holds one word of a group for each of the program's rows, and x's
        # tile [WG, GPT, 8] the same word's 8 inputs, so x reaches every row without a layout conversion. The words'
        # offsets are scattered (word w of a group stored at SCATTER * w % WG) so that the loads are not vectorized
        # (a vector would hold several words, x one word's inputs).
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        rg = tl.arange(0, GPT)
        rw = tl.arange(0, WG)
        rj = tl.arange(0, 8)
        w_ptrs = (
            w_ptr
            + (((rw * SCATTER) % WG)[:, None, None] + rg[None, :, None] * WG)
            + rn[None, None, :].to(tl.int64) * stride_wn
        )
        sz_ptrs = sz_ptr + rg[:, None] + rn[None, :].to(tl.int64) * stride_szn
        x_ptrs = x_ptr + (rw[:, None, None] * 8 + rg[None, :, None] * (8 * WG) + rj[None, None, :])
        acc = tl.zeros((WG, GPT, BLOCK_N), dtype=tl.float32)
        step = GPT * WG * 8
        mask_w = n_ok[None, None, :]
        mask_sz = n_ok[None, :]
        if EVEN_N:
            w_next = tl.load(w_ptrs)
            sz_next = tl.load(sz_ptrs)
        else:
            w_next = tl.load(w_ptrs, mask=mask_w, other=0)
            sz_next = tl.load(sz_ptrs, mask=mask_sz, other=0)
        for k in range(0, K, step):
            w, sz = w_next, sz_next
            if PREFETCH:  # the next tile's loads are in flight while this one is converted and multiplied
                more = k + step < K
                w_next = tl.load(w_ptrs + GPT * WG, mask=mask_w & more, other=0)
                sz_next = tl.load(sz_ptrs + GPT, mask=mask_sz & more, other=0)
            elif k + step < K:
                if EVEN_N:
                    w_next = tl.load(w_ptrs + GPT * WG)
                    sz_next = tl.load(sz_ptrs + GPT)
                else:
                    w_next = tl.load(w_ptrs + GPT * WG, mask=mask_w, other=0)
                    sz_next = tl.load(sz_ptrs + GPT, mask=mask_sz, other=0)
            x0, x1, x2, x3, x4, x5, x6, x7 = _split8(tl.load(x_ptrs).to(tl.float32))
            xs = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))  # a word's inputs summed: the zero point's share
            wh = w >> 12
            t = _nibble(w, x0, 0, False)
            t += _nibble(w, x1, 1, False)
            t += _nibble(w, x2, 2, False)
            t += _nibble(w, x3, 3, BIASED)
            t += _nibble(w, x4, 4, BIASED)
            t += _nibble(wh, x5, 5, False)
            t += _nibble(wh, x6, 6, BIASED)
            t += _nibble(wh, x7, 7, BIASED)
            if BIASED:  # nibbles 3, 4, 6, 7 carried 2^11, 2^7, 2^11, 2^7 times their x
                t -= (2048.0 * (x3 + x6) + 128.0 * (x4 + x7))[:, :, None]
            z = ((sz & 0x1F) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            s = (sz & ~0x1F).to(tl.float32, bitcast=True)
            acc += (t - z[None, :, :] * xs[:, :, None]) * s[None, :, :]
            w_ptrs += GPT * WG
            sz_ptrs += GPT
            x_ptrs += step
        y = tl.sum(tl.sum(acc, axis=0), axis=0)
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=n_ok)


SCATTER = 5  # word w of a group is stored at (SCATTER * w) % WG (odd: a permutation for any power-of-2 WG)


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
    return qweight.t()[
        :, scatter_index(qweight.shape[0], scales.shape[0], qweight.device)
    ].contiguous(), bits.t().contiguous()


def scatter_index(words: int, groups: int, device) -> torch.Tensor:
    """For each stored word of a row, the canonical word it holds: word w of a group at (SCATTER * w) % WG."""
    wg = words // groups
    pos = torch.arange(wg) * SCATTER % wg  # where word w goes
    inv = torch.empty(wg, dtype=torch.long)
    inv[pos] = torch.arange(wg)
    return (torch.arange(groups)[:, None] * wg + inv[None, :]).reshape(-1).to(device)


def gemv4_scales(sz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) [N, K // G] fp32 as `gemv4` reads them from `sz`."""
    return (sz & ~(2**ZERO_BITS - 1)).view(torch.float32), (sz & (2**ZERO_BITS - 1)).float()


def gemv4_ref(
    x: torch.Tensor, weight: torch.Tensor, sz: torch.Tensor, bias: torch.Tensor | None = None, out_dtype=None
) -> torch.Tensor:
    """What `gemv4` computes, in fp32 from the dequantized weight (up to summation order)."""
    N, KW = weight.shape
    order = torch.empty(KW, dtype=torch.long, device=weight.device)
    order[scatter_index(KW, sz.shape[1], weight.device)] = torch.arange(KW, device=weight.device)
    shifts = torch.arange(0, 32, 4, device=weight.device, dtype=torch.int32)
    q = ((weight[:, order, None] >> shifts) & 0xF).reshape(N, KW * 8).float()
    s, z = gemv4_scales(sz)
    G = KW * 8 // sz.shape[1]
    W = (q - z.repeat_interleave(G, 1)) * s.repeat_interleave(G, 1)
    y = x.float() @ W.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def gemv4_launch(N: int, K: int, G: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, GPT, num_warps, PREFETCH, BIASED): 8 rows a program over 8 groups a tile (until a sweep says otherwise)."""
    gpt = 8
    while (K // G) % gpt:
        gpt //= 2
    return 16, gpt, 4, 1, 0


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
    block_n, gpt, warps, prefetch, biased = config or gemv4_launch(N, K, G)
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
        SCATTER=SCATTER,
        BIASED=bool(biased),
        num_warps=warps,
        num_stages=1,
    )
    return out
