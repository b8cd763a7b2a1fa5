"""Rotary embedding of q and k, fused with the write of k and v into the paged cache.

Input is the fused qkv projection `[T, (H + 2*KVH) * D]`. q is rotated in
place; rotated k and v go to `slot_mapping[t]` of the layer's caches
`[num_blocks, KVH, block_size, D]` (slot = block * block_size + offset;
negative slots are padding and write nothing). Rotation follows HF Llama's
rotate-half convention: out[i] = x[i]*cos - x[i+D/2]*sin, out[i+D/2] = x[i+D/2]*cos + x[i]*sin.
Over an fp16 cache (a bf16 model's, see runner.py) q, k and v saturate at
fp16's +-65504, far beyond any real activation, so that the attention's fp16
products never meet an inf.

Quantized caches (int8, or fp8 E4M3 `float8_e4m3fn`) come with scale tensors
k_scale, v_scale, float32 `[num_blocks, KVH, block_size]`: one scale per token
and KV head, set when the token is written (no calibration; an outlier head or
token costs only its own precision). With a = max(absmax of the head's vector
(k after rotation), 2^-100) and QMAX 127 (int8) or 448 (fp8): scale = a / QMAX,
stored = round(clamp(x * (QMAX / a), +-QMAX)), rounding half to even (to an
integer for int8, to the nearest E4M3 value for fp8), both divisions correctly
rounded, so kernel and reference agree bit for bit where their rotated k
does. Dequantized: stored * scale; a zero vector stores zeros (its scale is
the tiny 2^-100 / QMAX) and comes back as exact zeros. Error per element, up
to fp32 rounding of x * (QMAX / a): int8 |x - x^| <= scale / 2; fp8 |x - x^|
<= 2^-4 |x| while |x| >= 2^-6 scale (E4M3's normal range), 2^-10 scale below,
so <= 16 scale = a / 28 < 2^-4 a overall. q is not quantized; it saturates at
fp16's range as over an fp16 cache, since the attention rounds it to fp16 for
its products with the dequantized tiles.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from llmserve.kernels import next_pow2, use_triton

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover
    triton = None


def rope_cos_sin(inv_freq: np.ndarray, max_pos: int, device: torch.device) -> torch.Tensor:
    """[max_pos, D/2, 2] float32: cos and sin of each position and frequency (inv_freq from layers/rope.py)."""
    inv_freq = torch.from_numpy(inv_freq).double()
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.stack([ang.cos(), ang.sin()], dim=-1).float().to(device)


F16_MAX = 65504.0


QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # quantized cache dtypes: largest stored magnitude
AMAX_FLOOR = 2.0**-100  # a vector's absmax, floored: a zero vector gets a tiny scale and dequantizes to 0


def saturation(cache_dtype: torch.dtype) -> float:
    """Bound on q, k and v: fp16's largest value over an fp16 cache (see the docstring), else none (0).
    Over a quantized cache it bounds q only (the attention's products are in fp16 there too)."""
    return F16_MAX if cache_dtype == torch.float16 or cache_dtype in QUANT_MAX else 0.0


def quantize_ref(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] in `dtype`, scales [...] float32), one absmax scale per vector."""
    qmax = QUANT_MAX[dtype]
    x = x.float()
    a = x.abs().amax(-1).clamp_min(AMAX_FLOOR)
    y = (x * (qmax / a)[..., None]).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = y.round()  # half to even
    return y.to(dtype), a / qmax  # fp8: the conversion rounds half to even


if triton is not None:
    _FLOOR = tl.constexpr(AMAX_FLOOR)

    @triton.jit
    def _sat(x, LIMIT: tl.constexpr):
        if LIMIT > 0:
            x = tl.clamp(x, -LIMIT, LIMIT)
        return x

    @triton.jit
    def _rot(x1, x2, cos, sin):
        """(x1 cos - x2 sin, x2 cos + x1 sin) with the fused multiply-adds spelled out: the compiler would
        pick where to fuse, kernel by kernel, and kernels/gemv.py's rope epilogue must give this one's bits."""
        return tl.fma(x1, cos, -(x2 * sin)), tl.fma(x2, cos, x1 * sin)

    @triton.jit
    def _rint(y, INTERPRET: tl.constexpr):
        """Round half to even. The interpreter has no libdevice: there, by floor (exact in numpy)."""
        if INTERPRET:
            f = tl.floor(y)
            d = y - f
            odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
            r = f + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)
            r = tl.where(r == 0.0, y * 0.0, r)  # -0.0 for y < 0, as rint
        else:
            r = libdevice.rint(y)
        return r

    @triton.jit
    def _to_grid(y, QMAX: tl.constexpr, INTERPRET: tl.constexpr):
        """y clamped to +-QMAX and, for int8, rounded half to even. For fp8 the conversion rounds (half to
        even, cvt.rn.satfinite on GPUs), but the interpreter's misrounds (7.75 -> 4): there y is put on
        E4M3's grid here, exactly."""
        y = tl.clamp(y, -QMAX, QMAX)
        if QMAX == 127.0:
            y = _rint(y, INTERPRET)
        elif INTERPRET:
            e = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # binade; subnormals at -6
            ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
            y = _rint(y / ulp, INTERPRET) * ulp
        return y

    @triton.jit
    def _quant_store(dst, sdst, x1, x2, mask, HALF: tl.constexpr, QMAX: tl.constexpr, INTERPRET: tl.constexpr):
        """Quantizes rows [x1 | x2] ([KVH_PAD, HALF] each, float32) with one scale per row (see the
        docstring); stores the values at `dst` (+HALF) and the scales at `sdst` ([KVH_PAD, 1])."""
        a = tl.maximum(tl.maximum(tl.max(tl.abs(x1), axis=1), tl.max(tl.abs(x2), axis=1)), _FLOOR)
        qmax = tl.full(a.shape, QMAX, tl.float32)
        inv = tl.math.div_rn(qmax, a)[:, None]
        tl.store(sdst, tl.math.div_rn(a, qmax)[:, None], mask=mask)
        ty = dst.dtype.element_ty
        tl.store(dst, _to_grid(x1 * inv, QMAX, INTERPRET).to(ty), mask=mask)
        tl.store(dst + HALF, _to_grid(x2 * inv, QMAX, INTERPRET).to(ty), mask=mask)

    @triton.jit
    def _rope_cache_kernel(
        qkv_ptr,
        pos_ptr,
        slot_ptr,
        cs_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        v_scale_ptr,
        stride_t,
        stride_cb,
        stride_ch,
        stride_sb,
        stride_sh,
        num_heads,
        num_kv_heads,
        HALF: tl.constexpr,
        H_PAD: tl.constexpr,
        KVH_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        LIMIT: tl.constexpr,
        QMAX: tl.constexpr,  # 0: an fp16/bf16/fp32 cache; 127 int8, 448 fp8 (quantized, with scales)
        INTERPRET: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        i = tl.arange(0, HALF)
        cos = tl.load(cs_ptr + pos * 2 * HALF + 2 * i)[None, :]
        sin = tl.load(cs_ptr + pos * 2 * HALF + 2 * i + 1)[None, :]
        D = 2 * HALF
        row = qkv_ptr + t * stride_t
        # q, in place
        h = tl.arange(0, H_PAD)[:, None]
        hm = h < num_heads
        p1 = row + h * D + i[None, :]
        x1 = tl.load(p1, mask=hm, other=0.0).to(tl.float32)
        x2 = tl.load(p1 + HALF, mask=hm, other=0.0).to(tl.float32)
        r1, r2 = _rot(x1, x2, cos, sin)
        tl.store(p1, _sat(r1, LIMIT).to(qkv_ptr.dtype.element_ty), mask=hm)
        tl.store(p1 + HALF, _sat(r2, LIMIT).to(qkv_ptr.dtype.element_ty), mask=hm)
        if slot >= 0:
            kh = tl.arange(0, KVH_PAD)[:, None]
            km = kh < num_kv_heads
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            dst = blk * stride_cb + kh * stride_ch + off * D + i[None, :]
            pk = row + num_heads * D + kh * D + i[None, :]
            k1 = tl.load(pk, mask=km, other=0.0).to(tl.float32)
            k2 = tl.load(pk + HALF, mask=km, other=0.0).to(tl.float32)
            if QMAX > 0:
                sdst = blk * stride_sb + kh * stride_sh + off
                k1r, k2r = _rot(k1, k2, cos, sin)
                _quant_store(k_cache_ptr + dst, k_scale_ptr + sdst, k1r, k2r, km, HALF, QMAX, INTERPRET)
                pv = pk + num_kv_heads * D
                v1 = tl.load(pv, mask=km, other=0.0).to(tl.float32)
                v2 = tl.load(pv + HALF, mask=km, other=0.0).to(tl.float32)
                _quant_store(v_cache_ptr + dst, v_scale_ptr + sdst, v1, v2, km, HALF, QMAX, INTERPRET)
            else:
                ty = k_cache_ptr.dtype.element_ty
                k1r, k2r = _rot(k1, k2, cos, sin)
                tl.store(k_cache_ptr + dst, _sat(k1r, LIMIT).to(ty), mask=km)
                tl.store(k_cache_ptr + dst + HALF, _sat(k2r, LIMIT).to(ty), mask=km)
                pv = pk + num_kv_heads * D
                v1 = tl.load(pv, mask=km, other=0.0).to(tl.float32)
                v2 = tl.load(pv + HALF, mask=km, other=0.0).to(tl.float32)
                tl.store(v_cache_ptr + dst, _sat(v1, LIMIT).to(ty), mask=km)
                tl.store(v_cache_ptr + dst + HALF, _sat(v2, LIMIT).to(ty), mask=km)


if triton is not None:

    @triton.jit
    def rope_pairs(
        x1, x2, r1, ok, qkv_ptr, pos, slot, cs_ptr, k_cache_ptr, v_cache_ptr, stride_cb, stride_ch, num_heads,
        num_kv_heads, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, LIMIT: tl.constexpr,
    ):  # fmt: skip
        """`_rope_cache_kernel` (an unquantized cache) for some (j, j + HALF) pairs of fp32 qkv rows: values x1,
        x2 of rows r1 = head * 2 * HALF + j and r1 + HALF, of the token(s) at `pos` (int64) whose cache slot is
        `slot` (int64; < 0: none) and whose row starts at `qkv_ptr`. One token (the GEMVs, gemv_epilogue.py):
        scalars and [P] vectors; several (kernels/skinny.py): [1, M] tokens by [P, 1] rows. Writes the row into
        `qkv_ptr` as that kernel leaves it (q rotated; k, v as they are) and k rotated and v into the caches, with
        the same arithmetic."""
        head = r1 // (2 * HALF)
        j = r1 % (2 * HALF)
        cos = tl.load(cs_ptr + pos * 2 * HALF + 2 * j, mask=ok, other=0.0)
        sin = tl.load(cs_ptr + pos * 2 * HALF + 2 * j + 1, mask=ok, other=0.0)
        rot1, rot2 = _rot(x1, x2, cos, sin)
        rot1, rot2 = _sat(rot1, LIMIT), _sat(rot2, LIMIT)
        is_q = head < num_heads
        is_v = head >= num_heads + num_kv_heads
        ty = qkv_ptr.dtype.element_ty
        tl.store(qkv_ptr + r1, tl.where(is_q, rot1, x1).to(ty), mask=ok)
        tl.store(qkv_ptr + r1 + HALF, tl.where(is_q, rot2, x2).to(ty), mask=ok)
        kh = tl.where(is_v, head - num_heads - num_kv_heads, head - num_heads).to(tl.int64)
        dst = (slot // BLOCK_SIZE) * stride_cb + kh * stride_ch + (slot % BLOCK_SIZE) * 2 * HALF + j
        cached = ok & (slot >= 0)
        is_k = cached & (head >= num_heads) & ~is_v
        cty = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + dst, rot1.to(cty), mask=is_k)
        tl.store(k_cache_ptr + dst + HALF, rot2.to(cty), mask=is_k)
        tl.store(v_cache_ptr + dst, _sat(x1, LIMIT).to(cty), mask=cached & is_v)
        tl.store(v_cache_ptr + dst + HALF, _sat(x2, LIMIT).to(cty), mask=cached & is_v)


def _rotate(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """x [T, n, D], cs [T, D/2, 2] -> rotated x (float32)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cs[:, None, :, 0], cs[:, None, :, 1]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_and_cache_ref(
    qkv, positions, slot_mapping, cos_sin, k_cache, v_cache, num_heads, num_kv_heads, k_scale=None, v_scale=None
):
    T = qkv.shape[0]
    D = k_cache.shape[-1]
    bs = k_cache.shape[2]
    q = qkv[:, : num_heads * D].view(T, num_heads, D)
    k = qkv[:, num_heads * D : (num_heads + num_kv_heads) * D].view(T, num_kv_heads, D)
    v = qkv[:, (num_heads + num_kv_heads) * D :].view(T, num_kv_heads, D)
    cs = cos_sin[positions.long()]
    lim = saturation(k_cache.dtype)

    def clip(x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-lim, lim) if lim else x

    q.copy_(clip(_rotate(q, cs)).to(q.dtype))
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blk, off = slots // bs, slots % bs
    if k_scale is None:
        k_cache[blk, :, off] = clip(_rotate(k[keep], cs[keep])).to(k_cache.dtype)
        v_cache[blk, :, off] = clip(v[keep].float()).to(v_cache.dtype)
        return
    k_cache[blk, :, off], k_scale[blk, :, off] = quantize_ref(_rotate(k[keep], cs[keep]), k_cache.dtype)
    v_cache[blk, :, off], v_scale[blk, :, off] = quantize_ref(v[keep], v_cache.dtype)


def rope_and_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Rotates q in place inside `qkv`; writes rotated k and v into the caches (quantized, with their
    scales into `k_scale`/`v_scale`, when the caches are int8 or fp8)."""
    quant = QUANT_MAX.get(k_cache.dtype, 0.0)
    assert (k_scale is not None) == (v_scale is not None) == (quant > 0), "scales go with an int8/fp8 cache"
    args = (qkv, positions, slot_mapping, cos_sin, k_cache, v_cache, num_heads, num_kv_heads, k_scale, v_scale)
    if not use_triton(qkv):
        return rope_and_cache_ref(*args)
    D = k_cache.shape[-1]
    assert qkv.stride(1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    if quant:
        assert k_scale.is_contiguous() and v_scale.is_contiguous() and k_scale.shape == k_cache.shape[:3]
    else:
        k_scale = v_scale = k_cache  # not read
    _rope_cache_kernel[(qkv.shape[0],)](
        qkv,
        positions,
        slot_mapping,
        cos_sin,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        qkv.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_scale.stride(0) if quant else 0,
        k_scale.stride(1) if quant else 0,
        num_heads,
        num_kv_heads,
        HALF=D // 2,
        H_PAD=next_pow2(num_heads),
        KVH_PAD=next_pow2(num_kv_heads),
        BLOCK_SIZE=k_cache.shape[2],
        LIMIT=saturation(k_cache.dtype),
        QMAX=quant,
        INTERPRET=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=4,
    )
