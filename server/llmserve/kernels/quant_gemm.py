"""Weight-only quantized GEMMs: y = x @ W.T (+ bias) with W in its canonical w8 / w4 form (quant/__init__.py),
dequantized tile by tile in registers and never written out; fp32 accumulation, output in `out_dtype`.

`w8a16_linear`: qweight int8 [N, K], scale fp32 [N]; W[n, k] = qweight[n, k] * scale[n].
`w4a16_linear`: qweight int32 [K // 8, N] (nibble j of word [r, n] is q[8r + j, n], 0..15), scales and zeros
[K // G, N]; W[n, k] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n].

Layout. Both kernels compute out.T = W @ x.T ("swap AB"): the weight tile is the MMA's first operand, which
Hopper's wgmma reads from registers, so it is dequantized in registers right before the MMA (global -> shared
by pipelined async copies -> registers -> tensor cores) and the MMAs run asynchronously to the next tile's
dequantization. Weight rows are the MMA's M dimension (64 per warp group), x's rows its N dimension (16 and
up): a decode step of 1 row costs the tile of 16. Integers become floats without conversion instructions
(a quarter-rate I2F per weight would cost as much as reading it): w4 ORs a nibble into a float's mantissa
(bits of MAGIC + q) and subtracts MAGIC + zero; int8 -> bf16 is Triton's byte permute and packed subtract.
w4 unpacks its words with joins, so each thread holds 8 consecutive K rows of a column and reaches the MMA's
operand layout by one 16-byte shared store and an ldmatrix per 8 weights; w8 at small M permutes K within
each 16 (the sum does not care) so that each thread's operand bytes are 4 consecutive ones (see _w8a16_kernel).

One row (batch-1 decode) of w8 goes to kernels/gemv.py instead (a CUDA-core GEMV: no tile padding, no
split-K); w4's one row to PyTorch's tinygemm where its operands were made (quant/methods.py).

Small M (<= 64, decode) is memory bound: the goal is to stream the weight at copy bandwidth, so tiles of 64
or 128 weight rows cover all of x's rows and a slice of K (split-K), enough programs to fill every SM once.
The slices' partial sums meet by fp32 atomic adds into a zeroed fp32 output: their order, and so the last
bits, may vary run to run, which is accepted for these shapes only. Dequantization there is exact: the MMA
takes the integer weights (q, or q - zero) and the scales multiply the fp32 partial sums (w8: once per
channel; w4: per K tile, one group).

Large M (prefill) is compute bound: tiles of up to 256 x 128 (the largest, not much wider than M, that still
gives about a tile per SM), one pass over K each: no atomics, deterministic. w8 still scales after the MMAs; w4 rounds each weight
to x's dtype ((q - z) * s in fp32, one rounding), as a dense bf16/fp16 weight would be, so that the MMAs
chain in the accumulator. fp32 x runs tf32x3 MMAs (about fp32 accuracy) on smaller tiles.

Block sizes come from a fixed heuristic (no autotuning: every launch may be captured in a CUDA graph); the
register and shared-memory figures it counts on are those of sm_90 builds.
"""

from __future__ import annotations

import functools

import torch

from llmserve.kernels import next_pow2, use_triton
from llmserve.kernels.gemv import gemv, gemv_ok
from llmserve.kernels.quant_dequant import DEQUANT_M, w4_dequant_mm, w8_dequant_mm

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

SMALL_M = 64  # up to this many rows: the memory-bound decode configuration (split-K, atomics)

if triton is not None:

    @triton.jit
    def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
        """Program -> (x-row tile, weight-row tile): GROUP x-row tiles sweep the weight rows together."""
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP * tiles_n
        first_m = (pid // per_group) * GROUP
        size = min(tiles_m - first_m, GROUP)
        return first_m + (pid % per_group) % size, (pid % per_group) // size

    @triton.jit
    def _epilogue(
        acc, b_ptr, out_ptr, offs_n, offs_m, stride_om, N, M, first, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr
    ):
        """acc [BLOCK_N, BLOCK_M] (fp32, scaled) -> out[m, n], bias added once (by the first K slice)."""
        n_ok = offs_n < N
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok & first, other=0.0).to(tl.float32)[:, None]
        ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        mask = n_ok[:, None] & (offs_m < M)[None, :]
        if ATOMIC:
            tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
        else:
            tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _int8_to(w, DT: tl.constexpr):
        """int8 -> DT, exactly. Triton's own bf16 conversion is a byte permute and a packed subtract; for fp16 it
        converts one element per (quarter-rate) I2F, so fp16 takes the magic number: bits 0x6400 + 128 + q
        are 1024 + 128 + q."""
        if DT == tl.float16:
            return (w.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True) - 1152.0
        return w.to(DT)

    @triton.jit
    def _w8a16_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        b_ptr,
        out_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_xk,
        stride_wn,
        stride_wk,
        stride_om,
        iters_per_split,
        HAS_BIAS: tl.constexpr,
        ATOMIC: tl.constexpr,
        EVEN_K: tl.constexpr,
        PREC: tl.constexpr,
        PERM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP: tl.constexpr,
    ):
        # PERM: the MMA's operand layout gives each thread the K pairs (2t, 2t + 1) and (2t + 8, 2t + 9) of
        # every 16; reading the tile in K order, each thread would fetch int8 pairs (2-byte shared loads) and
        # shuffle bytes. Permuting K within each 16 (MMA position 8h + 2t + e takes row 4t + 2h + e) hands
        # each thread 4 consecutive bytes instead; x's rows follow the same permutation (4-byte copies).
        pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP)
        pid_k = tl.program_id(1)
        it0 = pid_k * iters_per_split
        it1 = min(it0 + iters_per_split, tl.cdiv(K, BLOCK_K))
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = it0 * BLOCK_K + tl.arange(0, BLOCK_K)
        if PERM:
            pos = tl.arange(0, BLOCK_K)
            offs_kx = it0 * BLOCK_K + (pos // 16) * 16 + (pos // 2 % 4) * 4 + (pos // 8 % 2) * 2 + pos % 2
            offs_kx = tl.max_contiguous(tl.multiple_of(offs_kx, 2), 2)  # pairs: 4-byte async copies
        else:
            offs_kx = offs_k
        n_ok = offs_n < N
        m_ok = offs_m < M
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk
        x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_kx[:, None] * stride_xk
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for _ in range(it0, it1):
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
                xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None] & (offs_k < K)[None, :], other=0)
                xt = tl.load(x_ptrs, mask=m_ok[None, :] & (offs_kx < K)[:, None], other=0.0)
                offs_k += BLOCK_K
                offs_kx += BLOCK_K
            if PERM:
                w = tl.reshape(
                    tl.permute(tl.reshape(w, (BLOCK_N, BLOCK_K // 16, 4, 2, 2)), (0, 1, 3, 2, 4)), (BLOCK_N, BLOCK_K)
                )
            # int8 -> x's dtype is exact; the per-channel scale is applied once, after the K loop.
            acc = tl.dot(_int8_to(w, xt.dtype), xt, acc, input_precision=PREC)
            w_ptrs += BLOCK_K * stride_wk
            x_ptrs += BLOCK_K * stride_xk
        acc *= tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
        _epilogue(acc, b_ptr, out_ptr, offs_n, offs_m, stride_om, N, M, pid_k == 0, HAS_BIAS, ATOMIC)

    @triton.jit
    def _q_minus_z(q, z, DT: tl.constexpr):
        """q - z in DT, exactly, without an int -> float conversion instruction: q | bits(MAGIC) is MAGIC + q
        (MAGIC's last place is 1), and MAGIC + z is exact for an integer zero point (0..16)."""
        if DT == tl.bfloat16:
            qb = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 128 + q
            return qb - (z + 128.0).to(tl.bfloat16)
        elif DT == tl.float16:
            qh = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + q
            return qh - (z + 1024.0).to(tl.float16)
        else:
            return (q | 0x4B000000).to(tl.float32, bitcast=True) - (z + 8388608.0)  # 2**23 + q

    @triton.jit
    def _unpack(p, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Words [BLOCK_N, BLOCK_K // 8] -> nibbles [BLOCK_N, BLOCK_K] in 0..15, K in order (column 8r + j:
        nibble j of word r). Built by joins, so a thread's 8 nibbles stay in its registers, in K order: the
        move to the MMA's operand layout is then one 16-byte shared store and an ldmatrix per 8 weights."""
        b0 = tl.join(p & 0xF, (p >> 4) & 0xF)  # [BLOCK_N, R, 2 (j % 2)]
        b1 = tl.join((p >> 8) & 0xF, (p >> 12) & 0xF)
        b2 = tl.join((p >> 16) & 0xF, (p >> 20) & 0xF)
        b3 = tl.join((p >> 24) & 0xF, (p >> 28) & 0xF)  # the arithmetic shift's sign bits are masked off
        q = tl.join(tl.join(b0, b1), tl.join(b2, b3))  # [BLOCK_N, R, 2 (j % 2), 2 (j // 2 % 2), 2 (j // 4)]
        return tl.reshape(tl.permute(q, (0, 1, 4, 3, 2)), (BLOCK_N, BLOCK_K))

    @triton.jit
    def _w4a16_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        z_ptr,
        b_ptr,
        out_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_xk,
        stride_wr,
        stride_wn,
        stride_sg,
        stride_sn,
        stride_zg,
        stride_zn,
        stride_om,
        iters_per_split,
        HAS_BIAS: tl.constexpr,
        ATOMIC: tl.constexpr,
        EVEN_K: tl.constexpr,
        PREC: tl.constexpr,
        G: tl.constexpr,
        GMODE: tl.constexpr,
        FACTOR: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP: tl.constexpr,
    ):
        # GMODE 0: a K tile lies in one quantization group (G % BLOCK_K == 0): one row of scales and zeros.
        # 1: each word's 8 rows do (G % 8 == 0): a row per word. 2: any G, gathered per element.
        # FACTOR (GMODE 0 only): the MMA takes the exact q - z and the tile's partial sum is scaled in fp32.
        # Else the weight is rounded to x's dtype, (q - z) * s in fp32 (one rounding), and the MMAs chain.
        DT: tl.constexpr = x_ptr.dtype.element_ty
        R: tl.constexpr = BLOCK_K // 8
        pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP)
        pid_k = tl.program_id(1)
        it0 = pid_k * iters_per_split
        it1 = min(it0 + iters_per_split, tl.cdiv(K, BLOCK_K))
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_r = it0 * R + tl.arange(0, R)
        offs_k = it0 * BLOCK_K + tl.arange(0, BLOCK_K)
        n_ok = offs_n < N
        m_ok = offs_m < M
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_r[None, :].to(tl.int64) * stride_wr  # [BLOCK_N, R]
        x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None] * stride_xk  # [BLOCK_K, BLOCK_M]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for it in range(it0, it1):
            if EVEN_K:
                p = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
                xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            else:
                p = tl.load(w_ptrs, mask=n_ok[:, None] & (offs_r < K // 8)[None, :], other=0)
                xt = tl.load(x_ptrs, mask=m_ok[None, :] & (offs_k < K)[:, None], other=0.0)
            q = _unpack(p, BLOCK_N, BLOCK_K)
            if GMODE == 0:
                g = (it * BLOCK_K) // G
                z = tl.load(z_ptr + g * stride_zg + offs_n * stride_zn, mask=n_ok, other=0.0)[:, None]
                s = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            else:
                if GMODE == 1:
                    g = (offs_r * 8 // G)[None, :]
                    gm = n_ok[:, None] & (offs_r < K // 8)[None, :]
                else:
                    g = (offs_k // G)[None, :]
                    gm = n_ok[:, None] & (offs_k < K)[None, :]
                z = tl.load(z_ptr + g * stride_zg + offs_n[:, None] * stride_zn, mask=gm, other=0.0)
                s = tl.load(s_ptr + g * stride_sg + offs_n[:, None] * stride_sn, mask=gm, other=0.0).to(tl.float32)
                if GMODE == 1:  # a word's row -> its 8 columns
                    z = tl.reshape(tl.broadcast_to(z[:, :, None], (BLOCK_N, R, 8)), (BLOCK_N, BLOCK_K))
                    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, R, 8)), (BLOCK_N, BLOCK_K))
            if FACTOR:
                acc += tl.dot(_q_minus_z(q, z, DT), xt, input_precision=PREC) * s
            else:
                acc = tl.dot((_q_minus_z(q, z, tl.float32) * s).to(DT), xt, acc, input_precision=PREC)
            offs_r += R
            offs_k += BLOCK_K
            w_ptrs += R * stride_wr
            x_ptrs += BLOCK_K * stride_xk
        _epilogue(acc, b_ptr, out_ptr, offs_n, offs_m, stride_om, N, M, pid_k == 0, HAS_BIAS, ATOMIC)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # TRITON_INTERPRET on a CPU: few "SMs", so that small test shapes still split K
    return torch.cuda.get_device_properties(device).multi_processor_count


# Large M: (BLOCK_M, BLOCK_N, num_warps, num_stages), biggest tile first; the first that gives about a tile
# per SM wins (a 256 x 128 tile does twice the MMA work of 128 x 128 for the same dequantization and
# bookkeeping instructions, but at M = 256 it would leave most SMs idle).
_LARGE = ((256, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 4), (64, 64, 4, 4))
# Small M: BLOCK_M (M's bucket) -> (BLOCK_N, num_warps). wgmma takes weight rows in 64s per warp group and x rows
# in 16s; more x rows per tile, more weight rows too, so that x (read again by every weight tile) stays small.
_SMALL = {16: (64, 4), 32: (128, 8), 64: (128, 8)}


def _config(M: int, N: int, small_k: int, sms: int, wide: bool) -> dict:
    """Tile sizes for M's bucket. small_k: the format's K tile for decode shapes; wide: x is fp32 (tf32x3 MMAs
    on 4-byte operands: smaller tiles, fewer stages, to fit the registers and shared memory)."""
    if M <= SMALL_M:
        bm = 16 if M <= 16 else 32 if M <= 32 else 64
        if wide:
            return dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=2)
        bn, warps = _SMALL[bm]
        bk = small_k if bm == 16 else min(small_k, 128)
        return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=4 if bm < 64 else 3)
    # no wider than M needs (MMA columns past M are wasted work); fp32 x (4-byte operands) takes the small ones
    tiles = [t for t in (_LARGE[3:] if wide else _LARGE) if t[0] <= max(64, next_pow2(M))]
    fills = [t for t in tiles if _cdiv(M, t[0]) * _cdiv(N, t[1]) >= 0.9 * sms]
    bm, bn, warps, stages = fills[0] if fills else tiles[-1]
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, num_warps=warps, num_stages=2 if wide else stages)


def _split(M: int, N: int, K: int, cfg: dict, sms: int, per_sm: dict[int, int]) -> tuple[int, int]:
    """(K slices, K tiles per slice). Small M: as many slices as make the programs fill the GPU once
    (per_sm[BLOCK_M]: programs that fit on an SM at once, from their registers and shared memory on sm_90),
    each slice at least two K tiles long; large M: one slice (no atomics, deterministic)."""
    iters = max(1, _cdiv(K, cfg["BLOCK_K"]))
    split = 1
    if M <= SMALL_M:
        tiles = _cdiv(N, cfg["BLOCK_N"])
        split = max(1, min(per_sm[cfg["BLOCK_M"]] * sms // tiles, iters // 2))
    per_split = _cdiv(iters, split)
    return _cdiv(iters, per_split), per_split  # no empty slice


# w8, up to 16 rows (batch-1 decode): 128 weight rows x 128 K a tile, 4 warps, 3 stages, K split so that about
# 4 tiles per SM stream at once. Swept on an H100 over the 8B shapes (scripts/lab/sweep_w8_decode.py): 1.1-1.5x
# faster than 64 x 256 tiles with 2 per SM, about 1.24x the weights' memory floor over a layer.
_W8_DECODE = dict(BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)


def _plan_w8(M: int, N: int, K: int, sms: int, wide: bool = False) -> tuple[dict, int, int]:
    """(kernel meta-parameters, K slices, K tiles per slice) of w8a16_linear."""
    cfg = _config(M, N, 256, sms, wide)
    if M <= 16 and not wide:
        cfg.update(_W8_DECODE)
    elif SMALL_M < M <= 256 and not wide:  # large decode batches: K tiles of 128 (the same sweep, M = 256: 5-25%)
        cfg["BLOCK_K"] = 128
    split, per_split = _split(M, N, K, cfg, sms, {16: 2 if wide else 4, 32: 2, 64: 1})
    meta = dict(cfg, ATOMIC=split > 1, EVEN_K=K % cfg["BLOCK_K"] == 0, PERM=M <= SMALL_M, GROUP=8)
    return meta, split, per_split


def _plan_w4(M: int, N: int, K: int, G: int, sms: int, wide: bool = False) -> tuple[dict, int, int]:
    """(kernel meta-parameters, K slices, K tiles per slice) of w4a16_linear."""
    cfg = _config(M, N, 128, sms, wide)
    bk = cfg["BLOCK_K"]
    while bk > 64 and G % bk:
        bk //= 2
    if G % bk == 0:  # a smaller K tile that lies in one group (G = 64) beats a scale per word (G = 32)
        cfg["BLOCK_K"] = bk
    gmode = 0 if G % cfg["BLOCK_K"] == 0 else 1 if G % 8 == 0 else 2
    if gmode == 2:  # scales and zeros gathered per element: a [BLOCK_N, BLOCK_K] tile each, per stage
        cfg["num_stages"] = 2
    split, per_split = _split(M, N, K, cfg, sms, {16: 4, 32: 2, 64: 1})
    # G is a compile-time constant: the group of a K tile is then a shift, not an integer division per tile
    meta = dict(cfg, ATOMIC=split > 1, EVEN_K=K % cfg["BLOCK_K"] == 0, G=G, GMODE=gmode, GROUP=8)
    meta.update(FACTOR=gmode == 0 and M <= SMALL_M)
    return meta, split, per_split


def _launch_out(M: int, N: int, split: int, out_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if split > 1:  # atomics accumulate in fp32 over zeros; cast after if another dtype was asked for
        return torch.zeros(M, N, dtype=torch.float32, device=device)
    return torch.empty(M, N, dtype=out_dtype, device=device)


def _prec(x: torch.Tensor) -> str:
    return "tf32x3" if x.dtype == torch.float32 else "tf32"  # fp32 x: ~fp32-accurate products on tensor cores


def w8a16_linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    W = qweight.float() * scale.float()[:, None]
    y = x.float() @ W.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def w8a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32) @ (qweight int8 [N, K] * scale fp32 [N, 1]).T (+ bias [N]), fp32 accumulation,
    -> [M, N] in `out_dtype` (default x's)."""
    N = qweight.shape[0]
    if not use_triton(x) or x.numel() == 0 or N == 0:
        return w8a16_linear_ref(x, qweight, scale, bias, out_dtype)
    out_dtype = out_dtype or x.dtype
    M, K = x.shape
    scale = scale.contiguous()
    bias = bias.contiguous() if bias is not None else None
    if gemv_ok(x, qweight):  # batch-1 decode: kernels/gemv.py
        return gemv(x, qweight, scale, 0, bias, out_dtype)
    dense_ok = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and qweight.is_contiguous()
    if M >= DEQUANT_M and dense_ok:  # prefill: quant_dequant.py
        return w8_dequant_mm(x, qweight, scale, bias, out_dtype)
    meta, split, per_split = _plan_w8(M, N, K, _num_sms(x.device), x.dtype == torch.float32)
    out = _launch_out(M, N, split, out_dtype, x.device)
    grid = (_cdiv(M, meta["BLOCK_M"]) * _cdiv(N, meta["BLOCK_N"]), split)
    _w8a16_kernel[grid](
        x,
        qweight,
        scale,
        bias if bias is not None else scale,
        out,
        M,
        N,
        K,
        x.stride(0),
        x.stride(1),
        qweight.stride(0),
        qweight.stride(1),
        out.stride(0),
        per_split,
        HAS_BIAS=bias is not None,
        PREC=_prec(x),
        **meta,
    )
    return out if out.dtype == out_dtype else out.to(out_dtype)


def w4a16_linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    K = qweight.shape[0] * 8
    G = K if group_size <= 0 else group_size
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = ((qweight[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(K, -1).float()  # [K, N]
    g = torch.arange(K, device=qweight.device) // G
    W = (q - zeros.float()[g]) * scales.float()[g]  # [K, N]
    y = x.float() @ W
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32) @ W.T (+ bias [N]) for canonical w4 (qweight int32 [K // 8, N], scales and
    zeros [K // G, N]; group_size <= 0: one group over K), fp32 accumulation, -> [M, N] in `out_dtype`."""
    M, K = x.shape
    N = qweight.shape[1]
    G = K if group_size <= 0 else group_size
    if K % 8 or K % G or qweight.shape[0] * 8 != K:
        raise ValueError(f"w4a16_linear: K={K} is not 8 x qweight's {qweight.shape[0]} rows or not a multiple of G={G}")
    if not use_triton(x) or x.numel() == 0 or N == 0:
        return w4a16_linear_ref(x, qweight, scales, zeros, group_size, bias, out_dtype)
    out_dtype = out_dtype or x.dtype
    bias = bias.contiguous() if bias is not None else None
    dense_ok = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and scales.stride(1) == zeros.stride(1) == 1
    if M >= DEQUANT_M and dense_ok and qweight.is_contiguous():  # prefill: quant_dequant.py
        return w4_dequant_mm(x, qweight, scales, zeros, G, bias, out_dtype)
    meta, split, per_split = _plan_w4(M, N, K, G, _num_sms(x.device), x.dtype == torch.float32)
    out = _launch_out(M, N, split, out_dtype, x.device)
    grid = (_cdiv(M, meta["BLOCK_M"]) * _cdiv(N, meta["BLOCK_N"]), split)
    _w4a16_kernel[grid](
        x,
        qweight,
        scales,
        zeros,
        bias if bias is not None else zeros,
        out,
        M,
        N,
        K,
        x.stride(0),
        x.stride(1),
        qweight.stride(0),
        qweight.stride(1),
        scales.stride(0),
        scales.stride(1),
        zeros.stride(0),
        zeros.stride(1),
        out.stride(0),
        per_split,
        HAS_BIAS=bias is not None,
        PREC=_prec(x),
        **meta,
    )
    return out if out.dtype == out_dtype else out.to(out_dtype)
