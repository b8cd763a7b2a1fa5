"""Decode GEMV over 4-bit weights, 1-4 rows of x: y = x @ W.T, W[n, k] = (q[n, k] - z[n, g]) * s[n, g], g = k // G.

A decode step's products with few rows are bound by how fast the weights stream, and 4-bit weights carry twice
int8's weights a byte, so their conversion must cost few instructions. `gemv` (gemv.py) launches this kernel for
an int32 weight, with gemv.py's row epilogues (push, SwiGLU, rotary + cache, added in; the pending norm read or
left: `NormedRow`) at one row. Operands, made once at
load from the canonical w4 of quant/__init__.py (`gemv4_operands`):

- `weight` int32 [N, K // 8]: a word holds 8 consecutive k of a row, q[n, 8w + j] in bits 4j .. 4j+3 (canonical
  qweight transposed), with each group's WG = G / 8 words stored scattered: word w at (SCATTER w) mod WG;
- `sz` int32 [N, K // G]: per row and group, the scale's fp32 bits with the low 5 bits replaced by the integer zero
  point 0..31 (the scale keeps 18 of its 23 mantissa bits: relative error < 2^-18).

Conversion, without an integer-to-float instruction: nibble j stays where it is, and OR-ing the exponent of
M = 2^(23 - 4j) over it makes the float M + q (one logic op); less M (one exact add), times x (one fma). Nibbles
5-7 are shifted down by 12 first (bit 23 is the exponent's). Nibbles 3, 4, 6, 7 (M <= 2^11) keep their M, taken
off once a tile for all rows (a row's sum then keeps >= 13 bits of each q x). The zero point comes off through
the sum of a word's x, once a row and group: sum (q - z) x s = s (sum q x - z sum x).

Layout: tiles are [WG, GPT, BLOCK_N] (words of a group, groups, rows). The scattered offsets keep the loads at 4
bytes, so a thread holds one word of a group for each of the program's rows, laid out as x's tile [WG, GPT, 8]
(one word's 8 inputs a thread): x reaches every row without a layout conversion. (16-byte loads, 32 weights of
one row a thread, made Triton move every x tile through shared memory: 7% slower than PyTorch's tinygemm over an
8B layer, against 4% faster this way; docs/quantization.md.)

A program owns BLOCK_N whole rows and walks K a GPT-group tile at a time, the next tile's loads in flight: no
split-K, written once, the same bits every run.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from llmserve.kernels.gemv_epilogue import gemv_finish, gemv_rows, norm_factor, norm_parts
except ImportError:  # pragma: no cover
    triton = None

SCATTER = 5  # odd: a permutation of any power-of-2 number of words
ZERO_BITS = 5  # the zero point's bits in `sz`
GEMV4_MAX_M = 4  # rows of x a launch takes

if triton is not None:

    @triton.jit
    def _split8(x):
        """x [.., .., 8] -> its 8 slices along the last dimension, j = 0..7."""
        c0, c1 = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], 2, 2, 2)))
        b00, b01 = tl.split(c0)
        b10, b11 = tl.split(c1)
        x0, x4 = tl.split(b00)
        x2, x6 = tl.split(b01)
        x1, x5 = tl.split(b10)
        x3, x7 = tl.split(b11)
        return x0, x1, x2, x3, x4, x5, x6, x7

    @triton.jit
    def _nibble(w, J: tl.constexpr):
        """Nibble J of every word as the float M + q, M = 2^(23 - 4 JJ) (JJ: its place after the shift)."""
        JJ: tl.constexpr = J if J < 5 else J - 3
        return ((w & (0xF << (4 * JJ))) | ((150 - 4 * JJ) << 23)).to(tl.float32, bitcast=True)

    @triton.jit
    def _row_tile(w, wh, z, s, x_ptrs):
        """One row of x against the tile: sum over each word of (q - z) x, times s, [WG, GPT, BLOCK_N]."""
        x0, x1, x2, x3, x4, x5, x6, x7 = _split8(tl.load(x_ptrs).to(tl.float32))
        t = (_nibble(w, 0) - 8388608.0) * x0[:, :, None]
        t += (_nibble(w, 1) - 524288.0) * x1[:, :, None]
        t += (_nibble(w, 2) - 32768.0) * x2[:, :, None]
        t += _nibble(w, 3) * x3[:, :, None]
        t += _nibble(w, 4) * x4[:, :, None]
        t += (_nibble(wh, 5) - 32768.0) * x5[:, :, None]
        t += _nibble(wh, 6) * x6[:, :, None]
        t += _nibble(wh, 7) * x7[:, :, None]
        # nibbles 3, 4, 6, 7 carried 2^11, 2^7, 2^11, 2^7 times their x; the zero point, z times the word's x
        off = 2048.0 * (x3 + x6) + 128.0 * (x4 + x7)
        xs = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
        return (t - off[:, :, None] - z[None, :, :] * xs[:, :, None]) * s[None, :, :]

    @triton.jit
    def _gemv4_kernel(
        x_ptr,  # [ROWS, K] bf16 / fp16 / fp32
        w_ptr,  # int32 [N, K // 8], scattered words
        sz_ptr,  # int32 [N, K // G]
        b_ptr,  # [N] or unused
        out_ptr,  # [ROWS, N] ([N / 2] for EPI 2)
        N,
        K,
        stride_wn,
        stride_szn,
        stride_xm,
        stride_om,
        bases_ptr,  # the epilogues' operands, as gemv.py's kernel takes them
        epochs_ptr,
        slot,
        pos_ptr,
        slot_ptr,
        cs_ptr,
        k_cache_ptr,
        v_cache_ptr,
        stride_cb,
        stride_ch,
        num_heads,
        num_kv_heads,
        norm_parts_ptr,  # NORM: x is a NormedRow's u, and these its parts
        n_parts,
        eps,
        u_ptr,  # NEXT: the NormedRow this leaves (gemv_finish)
        gn_ptr,
        parts_ptr,
        HAS_BIAS: tl.constexpr,
        EVEN_N: tl.constexpr,
        ROWS: tl.constexpr,  # 1..4; the epilogues, NORM and NEXT at 1
        NORM: tl.constexpr,  # as gemv.py's kernel
        PARTS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        GPT: tl.constexpr,  # groups a tile (K // G a multiple of it)
        WG: tl.constexpr,  # words a group: G // 8
        SCATTER: tl.constexpr,
        EPI: tl.constexpr,
        NEXT: tl.constexpr,
        RANK: tl.constexpr,
        WORLD: tl.constexpr,
        HALF: tl.constexpr,
        CACHE_BLOCK: tl.constexpr,
        LIMIT: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rn, n_ok = gemv_rows(pid, N, BLOCK_N, EPI, HALF)
        rg = tl.arange(0, GPT)
        rw = tl.arange(0, WG)
        rj = tl.arange(0, 8)
        rows = rn[None, None, :].to(tl.int64) * stride_wn
        w_ptrs = w_ptr + (((rw * SCATTER) % WG)[:, None, None] + rg[None, :, None] * WG) + rows
        sz_ptrs = sz_ptr + rg[:, None] + rn[None, :].to(tl.int64) * stride_szn
        x_ptrs = x_ptr + (rw[:, None, None] * 8 + rg[None, :, None] * (8 * WG) + rj[None, None, :])
        acc0 = tl.zeros((WG, GPT, BLOCK_N), dtype=tl.float32)
        acc1 = tl.zeros((WG, GPT, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((WG, GPT, BLOCK_N), dtype=tl.float32)
        acc3 = tl.zeros((WG, GPT, BLOCK_N), dtype=tl.float32)
        step = GPT * WG * 8
        mask_w = n_ok[None, None, :]
        mask_sz = n_ok[None, :]
        if EVEN_N:
            w_next = tl.load(w_ptrs)
            sz_next = tl.load(sz_ptrs)
        else:
            w_next = tl.load(w_ptrs, mask=mask_w, other=0)
            sz_next = tl.load(sz_ptrs, mask=mask_sz, other=0)
        parts = norm_parts(norm_parts_ptr, n_parts, NORM, PARTS)
        for k in range(0, K, step):
            w, sz = w_next, sz_next
            more = k + step < K  # the next tile's loads are in flight while this one is converted and multiplied
            w_next = tl.load(w_ptrs + GPT * WG, mask=mask_w & more, other=0)
            sz_next = tl.load(sz_ptrs + GPT, mask=mask_sz & more, other=0)
            z = ((sz & 0x1F) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            s = (sz & ~0x1F).to(tl.float32, bitcast=True)
            wh = w >> 12
            acc0 += _row_tile(w, wh, z, s, x_ptrs)
            if ROWS > 1:
                acc1 += _row_tile(w, wh, z, s, x_ptrs + stride_xm)
            if ROWS > 2:
                acc2 += _row_tile(w, wh, z, s, x_ptrs + 2 * stride_xm)
            if ROWS > 3:
                acc3 += _row_tile(w, wh, z, s, x_ptrs + 3 * stride_xm)
            w_ptrs += GPT * WG
            sz_ptrs += GPT
            x_ptrs += step
        y = tl.sum(tl.sum(acc0, axis=0), axis=0)
        if NORM:
            y *= norm_factor(parts, K, eps)
        gemv_finish(
            y, rn, n_ok, pid, N, b_ptr, out_ptr, bases_ptr, epochs_ptr, slot, pos_ptr, slot_ptr, cs_ptr, k_cache_ptr,
            v_cache_ptr, stride_cb, stride_ch, num_heads, num_kv_heads, u_ptr, gn_ptr, parts_ptr, HAS_BIAS, EPI, NEXT,
            RANK, WORLD, HALF, CACHE_BLOCK, LIMIT, BLOCK_N,
        )  # fmt: skip
        if ROWS > 1:
            _store_row(acc1, rn, n_ok, b_ptr, out_ptr + stride_om, HAS_BIAS)
        if ROWS > 2:
            _store_row(acc2, rn, n_ok, b_ptr, out_ptr + 2 * stride_om, HAS_BIAS)
        if ROWS > 3:
            _store_row(acc3, rn, n_ok, b_ptr, out_ptr + 3 * stride_om, HAS_BIAS)

    @triton.jit
    def _store_row(acc, rn, n_ok, b_ptr, out_ptr, HAS_BIAS: tl.constexpr):
        y = tl.sum(tl.sum(acc, axis=0), axis=0)
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def scatter_index(words: int, groups: int, device: torch.device) -> torch.Tensor:
    """For each stored word of a row, the canonical word it holds (word w of a group at (SCATTER w) mod WG)."""
    wg = words // groups
    inv = torch.empty(wg, dtype=torch.long)
    inv[torch.arange(wg) * SCATTER % wg] = torch.arange(wg)
    return (torch.arange(groups)[:, None] * wg + inv[None, :]).reshape(-1).to(device)


def gemv4_operands(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Canonical w4 (qweight int32 [K // 8, N], scales and zeros [K // G, N]) -> (weight [N, K // 8], sz [N, K // G])
    as the kernel reads them; None where it cannot: a group of other than 8-256 weights (a power of 2), a zero
    point that is not an integer in 0..31, a scale that is not a positive normal float."""
    words, groups = qweight.shape[0], scales.shape[0]
    G = words * 8 // groups
    if G * groups != words * 8 or not (8 <= G <= 256 and G & (G - 1) == 0):
        return None
    z, s = zeros.float(), scales.float()
    if not (torch.equal(z, z.round()) and bool(((z >= 0) & (z < 2**ZERO_BITS)).all())):
        return None
    if not bool(((s >= torch.finfo(torch.float32).tiny) & torch.isfinite(s)).all()):
        return None
    sz = s.contiguous().view(torch.int32) & ~(2**ZERO_BITS - 1) | z.to(torch.int32)
    return qweight.t()[:, scatter_index(words, groups, qweight.device)].contiguous(), sz.t().contiguous()


def gemv4_dequantize(weight: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """W [N, K] fp32 from the kernel's operands (the reference's weight)."""
    N, words = weight.shape
    order = torch.empty(words, dtype=torch.long, device=weight.device)
    order[scatter_index(words, sz.shape[1], weight.device)] = torch.arange(words, device=weight.device)
    shifts = torch.arange(0, 32, 4, device=weight.device, dtype=torch.int32)
    q = ((weight[:, order, None] >> shifts) & 0xF).reshape(N, words * 8).float()
    s = (sz & ~(2**ZERO_BITS - 1)).view(torch.float32)
    z = (sz & (2**ZERO_BITS - 1)).float()
    G = words * 8 // sz.shape[1]
    return (q - z.repeat_interleave(G, 1)) * s.repeat_interleave(G, 1)


def gemv4_launch(K: int, G: int) -> tuple[int, int, int]:
    """(BLOCK_N, GPT, num_warps): 16 rows a program over 8 groups a tile, 4 warps, the fastest or within 4% on the
    8B shape's projections, whole and at MP_NUM=2, on an H100 (runs 123-124, docs/quantization.md)."""
    gpt = 8
    while (K // G) % gpt:
        gpt //= 2
    return 16, gpt, 4
