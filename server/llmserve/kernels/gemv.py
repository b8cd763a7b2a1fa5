"""Batch-1 decode GEMV: y = x @ (W * scale).T (+ bias), x one row, W int8, FP8 E4M3 or bf16/fp16 (no scale).

A batch-1 decode step reads every weight once and does two flops per weight byte: it is bound by how fast
the weights stream, not by arithmetic. The tensor-core kernels (quant_gemm.py, fp8_gemm.py) pad the one
row to an MMA tile of 16 and move each weight through shared memory twice (the pipeline's copy, the MMA
operand's layout); on the 8B projections they reach 1.3-1.5x the weights' memory floor, and cuBLAS's
bf16 GEMVs split K and add a reduce kernel. Here each thread loads 16 consecutive bytes of a row with
one 16-byte load, converts them in registers and multiplies them with x in fp32 on the CUDA cores: no
shared memory, no tile padding.

Every program owns BLOCK_N whole rows (all of K): no split-K, so no atomics, no zeroed output and no
second kernel; the result is written once, in the output dtype, and is the same run to run. Rows per
program are few (4-16), so even a rank's share of a projection (N = 3072) spans every SM more than once.
The accumulator is [BLOCK_N, BLOCK_K] and summed over K once, after the loop.

Scales: one per output row (`scale` [N]), applied after the sum; or one per (row block, K block)
(`scale` [ceil(N / SB), ceil(K / SB)], FP8's 128 x 128 blocks): a program's rows lie in one row block
(BLOCK_N divides SB), so x takes each K block's scale before the products.

int8 becomes fp32 exactly through the float's mantissa (bits 0x4B000080 + q are 2^23 + 128 + q), an integer
add and a float subtract instead of the quarter-rate integer-to-float conversion; FP8 through the
hardware's paired E4M3 -> f16 conversion (sm_89+); bf16 is a shift.

What becomes of the row (`gemv`'s push, glu, rope): written out; or pushed, as kernels/sum_norm.py's words,
into every rank's buffer of the fused sum that follows a row-parallel projection (FusedSumNorm.push); or,
for gate_up, silu(gate) * up (a program's rows alternate gate j, up j); or, for qkv, rotated and written
into the KV cache as kernels/rotary.py does it (a program's rows pair a head's j and j + D/2). The last two
give the separate kernels' bits and save their launches (two a layer). gemv_epilogue.py holds them, shared with
gemv4.py's kernel over 4-bit weights, which `gemv` launches for an int32 weight.

The RMSNorms between a layer's products need no kernel at batch 1 (model.py `Normed`): o's and down's GEMVs add
their row into the residual stream (`into`) and, from the sum, leave the next norm pending (`then_norm`: the sum
times the norm's weight, rounded once, and each program's sum of squares: a `NormedRow`); qkv's and gate_up's GEMVs
read that row as x and multiply their sums by the norm's 1 / rms (`norm`: 1 / rms is a common factor of a row's
products), from the parts loaded before their main loop and summed in one order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.kernels import next_pow2, switches, use_triton
from llmserve.kernels.gemv4 import GEMV4_MAX_M, SCATTER, gemv4_launch
from llmserve.kernels.pdl import launch_args, pdl_on
from llmserve.kernels.rotary import QUANT_MAX, saturation

try:
    import triton
    import triton.language as tl

    from llmserve.kernels.gemv4 import _gemv4_kernel
    from llmserve.kernels.gemv_epilogue import gemv_finish, gemv_rows, norm_factor, norm_parts
    from llmserve.kernels.pdl import pdl_launch_next, pdl_wait
except ImportError:  # pragma: no cover
    triton = None

# Products of at most this many rows run here (w8a16_linear, fp8_linear, unquantized layers, the LM head; CUDA)
GEMV_MAX_M = 1  # (none with the `gemv` switch off: kernels/switches.py)

if triton is not None:

    @triton.jit
    def _to_f32(w, CONV: tl.constexpr):
        """Weights -> fp32, exactly. CONV 0: the compiler's conversion; 1: int8 through the mantissa."""
        if CONV == 1:
            return (w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        return w.to(tl.float32)

    @triton.jit
    def _load_tile(ptrs, k, n_ok, rk, K, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
        if EVEN_N and EVEN_K:
            return tl.load(ptrs)
        return tl.load(ptrs, mask=n_ok[:, None] & ((k + rk) < K)[None, :], other=0.0)

    @triton.jit
    def _tile_product(acc, w, x_ptr, s_row, k, rk, K, CONV: tl.constexpr, EVEN_K: tl.constexpr, SB: tl.constexpr):
        """acc + the weight tile at column k times x's (block scales: x takes its K block's scale first)."""
        if EVEN_K:
            x = tl.load(x_ptr + k + rk).to(tl.float32)
        else:
            x = tl.load(x_ptr + k + rk, mask=(k + rk) < K, other=0.0).to(tl.float32)
        if SB > 0:  # BLOCK_N divides SB: the program's rows lie in one row of blocks
            x *= tl.load(s_row + (k + rk) // SB, mask=(k + rk) < K, other=0.0)
        return acc + _to_f32(w, CONV) * x[None, :]

    @triton.jit
    def _gemv_kernel(
        x_ptr,  # [K], x's dtype
        w_ptr,  # [N, K] int8 / float8e4nv / bf16 / fp16, K contiguous
        s_ptr,  # fp32: [N] (SB == 0), [ceil(N / SB), ceil(K / SB)] (SB > 0), or unused (SB < 0)
        b_ptr,  # [N] or unused
        out_ptr,  # [N] ([N / 2] for EPI 2)
        N,
        K,
        stride_wn,
        stride_sn,
        bases_ptr,  # EPI 1: kernels/sum_norm.py's buffers, of every rank
        epochs_ptr,  # EPI 1: its calls so far (of row 0)
        slot,  # EPI 1: its words a slot
        pos_ptr,  # EPI 3: the token's position, its cache slot, cos/sin, the layer's caches
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
        SB: tl.constexpr,
        CONV: tl.constexpr,
        EVEN_N: tl.constexpr,
        EVEN_K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PREFETCH: tl.constexpr,
        NORM: tl.constexpr,  # x is a pending RMSNorm's row (NormedRow): the product takes its 1 / rms
        PARTS: tl.constexpr,  # NORM: a power of 2 >= n_parts
        EPI: tl.constexpr,  # what becomes of the row: 0 stored, 1 pushed, 2 SwiGLU, 3 rotary + cache, 4 added in
        NEXT: tl.constexpr,  # EPI 4: and leaves the next norm's NormedRow
        RANK: tl.constexpr,  # EPI 1
        WORLD: tl.constexpr,
        HALF: tl.constexpr,  # EPI 3: half the head dim
        CACHE_BLOCK: tl.constexpr,
        LIMIT: tl.constexpr,
        PDL: tl.constexpr,  # launched with PDL (pdl.py)
    ):
        pid = tl.program_id(0)
        rn, n_ok = gemv_rows(pid, N, BLOCK_N, EPI, HALF)
        rk = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
        s_row = s_ptr
        if SB > 0:  # the scale row of the program's rows
            s_row += (pid * BLOCK_N // SB) * stride_sn
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        w = _load_tile(w_ptrs, 0, n_ok, rk, K, EVEN_N, EVEN_K)  # weights: before the wait (pdl.py)
        pdl_wait(PDL)
        parts = norm_parts(norm_parts_ptr, n_parts, NORM, PARTS)
        if PREFETCH:  # the next tile's loads are in flight while this one is multiplied
            for k in range(0, K, BLOCK_K):
                w_next = _load_tile(w_ptrs + BLOCK_K, k + BLOCK_K, n_ok, rk, K, EVEN_N, False)
                acc = _tile_product(acc, w, x_ptr, s_row, k, rk, K, CONV, EVEN_K, SB)
                w = w_next
                w_ptrs += BLOCK_K
        else:
            acc = _tile_product(acc, w, x_ptr, s_row, 0, rk, K, CONV, EVEN_K, SB)
            for k in range(BLOCK_K, K, BLOCK_K):
                w_ptrs += BLOCK_K
                w = _load_tile(w_ptrs, k, n_ok, rk, K, EVEN_N, EVEN_K)
                acc = _tile_product(acc, w, x_ptr, s_row, k, rk, K, CONV, EVEN_K, SB)
        pdl_launch_next(PDL)
        y = tl.sum(acc, axis=1)
        if SB == 0:  # SB < 0: no scale (bf16 weights)
            y *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)
        if NORM:
            y *= norm_factor(parts, K, eps)
        gemv_finish(
            y, rn, n_ok, pid, N, b_ptr, out_ptr, bases_ptr, epochs_ptr, slot, pos_ptr, slot_ptr, cs_ptr, k_cache_ptr,
            v_cache_ptr, stride_cb, stride_ch, num_heads, num_kv_heads, u_ptr, gn_ptr, parts_ptr, HAS_BIAS, EPI, NEXT,
            RANK, WORLD, HALF, CACHE_BLOCK, LIMIT, BLOCK_N,
        )  # fmt: skip


def gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    block: int = 0,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The product in fp32 from the dequantized weight (what `gemv` computes, up to summation order)."""
    W = weight.float()
    if scale is None:
        pass
    elif block:
        N, K = weight.shape
        W = W * scale.float().repeat_interleave(block, 0)[:N].repeat_interleave(block, 1)[:, :K]
    else:
        W = W * scale.float()[:, None]
    y = x.float() @ W.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def gemv_launch(N: int, itemsize: int = 1) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, PREFETCH) for N output rows of `itemsize`-byte weights, from sweeps on
    an H100 (scripts/lab/sweep_gemv.py; the 8B shape's projections, whole and at MP_NUM=2, and its LM head).
    8-bit: 8 x 1024 tiles were the fastest or within 3% up to 4096 rows, 16 x 512 (8 warps) on 6144 and
    16 x 256 on 14336-28672 (7-10% faster than 8 x 1024). 16-bit: 4 x 2048 on every shape."""
    if itemsize > 1:
        return 4, 2048, 4, 0
    if N >= 8192:
        return 16, 256, 4, 0
    if N > 4096:
        return 16, 512, 8, 0
    return 8, 1024, 4, 0


def gemv_ok(x: torch.Tensor, weight: torch.Tensor, block: int = 0) -> bool:
    """Whether `gemv` runs this product: the `gemv` switch on, at most GEMV_MAX_M rows (one; 4-bit weights, int32
    words: GEMV4_MAX_M), Triton, a K-contiguous weight, and (block scales) a block that the rows of a program divide."""
    most = (GEMV4_MAX_M if weight.dtype == torch.int32 else GEMV_MAX_M) if switches.current.gemv else 0
    if x.dim() != 2 or not 1 <= x.shape[0] <= most or not use_triton(x) or weight.stride(1) != 1:
        return False  # (no rows: the logits of a step that samples none)
    return block == 0 or block % gemv_launch(weight.shape[0], weight.element_size())[0] == 0


@dataclass(frozen=True)
class RopeCache:
    """kernels/rotary.py's `rope_and_cache` operands (an fp16/bf16/fp32 cache: no scales), for `gemv(rope=)`."""

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cos_sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_heads: int
    num_kv_heads: int


@dataclass(frozen=True)
class NormedRow:
    """An RMSNorm of one row x, pending: `u` = x * the norm's weight (its dtype) and `parts`, the sums of the squares
    of x's parts (fp32, one a program of the GEMV that left it: `gemv(into=, then_norm=)`). The norm's output is
    u / rms(x), and a GEMV that reads it (`gemv(norm=)`) takes the 1 / rms after its sum: the norm needs no kernel
    of its own. (u is rounded once, as the norm's kernel rounds its output; 1 / rms is applied in fp32.)"""

    u: torch.Tensor  # [1, K]
    parts: torch.Tensor  # fp32 [programs]
    eps: float


def rope_operands(rope: RopeCache | None, N: int, filler: torch.Tensor) -> tuple[tuple, int, int, float]:
    """(the kernel's rope operands, HALF, CACHE_BLOCK, LIMIT) of `rope` for a qkv product of N rows (the GEMVs',
    kernels/skinny.py's); without one, placeholders (`filler`: any tensor, never read)."""
    if rope is None:
        return (filler,) * 5 + (0,) * 4, 1, 1, 0.0
    kc = rope.k_cache
    half = kc.shape[-1] // 2
    if kc.dtype in QUANT_MAX or not (kc.is_contiguous() and rope.v_cache.is_contiguous()):
        raise ValueError("rope writes a contiguous fp16/bf16/fp32 cache (a quantized one: rope_and_cache)")
    if N != (rope.num_heads + 2 * rope.num_kv_heads) * 2 * half:
        raise ValueError(f"{N} rows are not the qkv of {rope.num_heads} + 2 x {rope.num_kv_heads} heads")
    args = (rope.positions, rope.slot_mapping, rope.cos_sin, kc, rope.v_cache, kc.stride(0), kc.stride(1))
    return args + (rope.num_heads, rope.num_kv_heads), half, kc.shape[2], saturation(kc.dtype)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    block: int = 0,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: tuple[int, int, int, int] | None = None,
    conv: int | None = None,
    push: tuple[torch.Tensor, torch.Tensor, int, int, int] | None = None,
    glu: bool = False,
    rope: RopeCache | None = None,
    norm: NormedRow | None = None,
    into: torch.Tensor | None = None,
    then_norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor | NormedRow | None:
    """x [1, K] @ (weight [N, K] int8 or float8_e4m3fn, times scale).T (+ bias [N]) -> [1, N] in out_dtype
    (default x's). scale: fp32 [N] (block 0), or [ceil(N / block), ceil(K / block)]; None with a bf16/fp16
    weight (unquantized layers, the LM head). 4-bit weights: `weight` int32 [N, K // 8] and `scale` int32
    [N, K // G], gemv4.py's operands, and x 1-4 rows [M, K] -> [M, N] (the epilogues below at one row).
    config, conv: the launch and the conversion, for the sweep (defaults: gemv_launch; the mantissa path for
    int8; 4-bit weights: gemv4_launch). At most one of:
    push: (bases, epochs, rank, world, slot) of a FusedSumNorm, which then gets the fp32 row instead of the
      caller (returns None);
    glu: the weight is a gate | up projection [2n, K], and the result is silu(gate) * up [1, n] in out_dtype;
    rope: the weight is a qkv projection, and the result is what `rope_and_cache` leaves of it (q rotated),
      the rotated k and v written into the cache.
    into: a [1, N] tensor the result is added into, in place (returned): a projection's row into the residual
      stream (model.py `Normed`); with then_norm (the next RMSNorm's weight [N], eps), it returns that norm of
      the sum, pending (`NormedRow`), instead.
    glu and rope compute from the same fp32 rows as the product alone (the same launch), then as the
    separate kernel does: its bits. With any of them, norm: x is that NormedRow's u, and the product is of the
    norm's output (one row)."""
    N, K = weight.shape
    w4 = weight.dtype == torch.int32  # 4-bit weights: gemv4.py's operands, `scale` their scale-and-zero words
    if w4:
        K *= 8
    rows = x.shape[0] if w4 else 1
    if x.dim() != 2 or x.shape[1] != K or not 1 <= x.shape[0] <= (GEMV4_MAX_M if w4 else 1):
        raise ValueError(f"gemv: x {tuple(x.shape)} is not {'1-4 rows' if w4 else 'one row'} of K={K}")
    if w4 and (block or scale is None or scale.dtype != torch.int32):
        raise ValueError("gemv: 4-bit weights take their int32 scale-and-zero words (gemv4_operands), no block")
    if w4:
        block_n, gpt, warps = gemv4_launch(K, K // scale.shape[1])
    else:
        block_n, block_k, warps, prefetch = config or gemv_launch(N, weight.element_size())
    if block % block_n:
        raise ValueError(f"gemv: BLOCK_N={block_n} does not divide the scale block {block}")
    epi = 1 if push is not None else 2 if glu else 3 if rope is not None else 4 if into is not None else 0
    pairs = epi in (2, 3)
    if (push is not None) + glu + (rope is not None) + (into is not None) > 1 or (pairs and (N % 2 or block_n % 2 or block)):  # fmt: skip
        raise ValueError("gemv: one of push, glu, rope, into; glu and rope take pairs of rows (an even N, no scale blocks)")  # fmt: skip
    if (epi or norm is not None) and rows > 1:
        raise ValueError("gemv: push, glu, rope, into and norm take one row")
    if into is not None and (into.shape != (1, N) or not into.is_contiguous()):
        raise ValueError(f"gemv: into {tuple(into.shape)} is not a contiguous [1, {N}]")
    if then_norm is not None and (into is None or then_norm[0].shape != (N,)):
        raise ValueError("gemv: then_norm takes into, and a weight of its N")
    if norm is not None and x.data_ptr() != norm.u.data_ptr():
        raise ValueError("gemv: with norm, x is its u")
    if conv is None:
        conv = 1 if weight.dtype == torch.int8 else 0
    x = x.contiguous()
    if scale is not None:
        scale = scale.contiguous()
    n_out = N // 2 if glu else N
    if into is not None:
        out = into
    else:
        out = weight if push is not None else torch.empty(rows, n_out, dtype=out_dtype or x.dtype, device=x.device)
    bases, epochs, rank, world, slot = push or (weight, weight, 0, 1, 0)
    rope_args, half, cache_block, limit = rope_operands(rope, N, weight)
    per_program = block_n // 2 if pairs else block_n  # outputs (glu), pairs (rope) or rows a program
    count = N // 2 if pairs else N
    grid = (triton.cdiv(count, per_program),)
    left = None
    if then_norm is not None:
        gn = then_norm[0]
        left = NormedRow(torch.empty(1, N, dtype=gn.dtype, device=x.device), torch.empty(grid[0], device=x.device), then_norm[1])  # fmt: skip
    norm_args = (norm.parts, norm.parts.numel(), norm.eps) if norm is not None else (weight, 0, 0.0)
    next_args = (left.u, gn, left.parts) if left is not None else (weight,) * 3
    epilogue = dict(EPI=epi, NEXT=left is not None, RANK=rank, WORLD=world, HALF=half, CACHE_BLOCK=cache_block, LIMIT=limit)  # fmt: skip
    normed = dict(NORM=norm is not None, PARTS=next_pow2(norm.parts.numel()) if norm is not None else 1)
    result = left if left is not None else None if push is not None else out
    bias_arg = bias if bias is not None else weight
    if w4:  # (not launched with PDL: pdl.py)
        _gemv4_kernel[grid](
            x, weight, scale, bias_arg, out, n_out, K, weight.stride(0), scale.stride(0), x.stride(0),
            out.stride(0) if push is None else 0, bases, epochs, slot, *rope_args, *norm_args, *next_args,
            HAS_BIAS=bias is not None, EVEN_N=count % per_program == 0, ROWS=rows, **normed, BLOCK_N=block_n, GPT=gpt,
            WG=K // scale.shape[1] // 8, SCATTER=SCATTER, **epilogue, num_warps=warps, num_stages=1,
        )  # fmt: skip
        return result
    _gemv_kernel[grid](
        x,
        weight,
        scale if scale is not None else weight,
        bias_arg,
        out,
        n_out,
        K,
        weight.stride(0),
        scale.stride(0) if scale is not None else 0,
        bases,
        epochs,
        slot,
        *rope_args,
        *norm_args,
        *next_args,
        HAS_BIAS=bias is not None,
        SB=block if scale is not None else -1,
        CONV=conv,
        EVEN_N=count % per_program == 0,
        EVEN_K=K % block_k == 0,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PREFETCH=bool(prefetch),
        **normed,
        **epilogue,
        PDL=(pdl := pdl_on(x)),
        num_warps=warps,
        num_stages=1,
        **launch_args(pdl),
    )
    return result
