"""Rotary embedding of q and k, fused with the write of k and v into the paged cache.

Input is the fused qkv projection `[T, (H + 2*KVH) * D]`. q is rotated in
place; rotated k and v go to `slot_mapping[t]` of the layer's caches
`[num_blocks, KVH, block_size, D]` (slot = block * block_size + offset;
negative slots are padding and write nothing). Rotation follows HF Llama's
rotate-half convention: out[i] = x[i]*cos - x[i+D/2]*sin, out[i+D/2] = x[i+D/2]*cos + x[i]*sin.
Over an fp16 cache (a bf16 model's, see runner.py) q, k and v saturate at
fp16's +-65504, far beyond any real activation, so that the attention's fp16
products never meet an inf.
"""

from __future__ import annotations

import numpy as np
import torch

from . import next_pow2, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def rope_cos_sin(inv_freq: np.ndarray, max_pos: int, device: torch.device) -> torch.Tensor:
    """[max_pos, D/2, 2] float32: cos and sin of each position and frequency (inv_freq from models/rope.py)."""
    inv_freq = torch.from_numpy(inv_freq).double()
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.stack([ang.cos(), ang.sin()], dim=-1).float().to(device)


F16_MAX = 65504.0


def saturation(cache_dtype: torch.dtype) -> float:
    """Bound on q, k and v: fp16's largest value over an fp16 cache (see the docstring), else none (0)."""
    return F16_MAX if cache_dtype == torch.float16 else 0.0


if triton is not None:

    @triton.jit
    def _sat(x, LIMIT: tl.constexpr):
        if LIMIT > 0:
            x = tl.clamp(x, -LIMIT, LIMIT)
        return x

    @triton.jit
    def _rope_cache_kernel(
        qkv_ptr,
        pos_ptr,
        slot_ptr,
        cs_ptr,
        k_cache_ptr,
        v_cache_ptr,
        stride_t,
        stride_cb,
        stride_ch,
        num_heads,
        num_kv_heads,
        HALF: tl.constexpr,
        H_PAD: tl.constexpr,
        KVH_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        LIMIT: tl.constexpr,
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
        tl.store(p1, _sat(x1 * cos - x2 * sin, LIMIT).to(qkv_ptr.dtype.element_ty), mask=hm)
        tl.store(p1 + HALF, _sat(x2 * cos + x1 * sin, LIMIT).to(qkv_ptr.dtype.element_ty), mask=hm)
        if slot >= 0:
            kh = tl.arange(0, KVH_PAD)[:, None]
            km = kh < num_kv_heads
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            dst = blk * stride_cb + kh * stride_ch + off * D + i[None, :]
            pk = row + num_heads * D + kh * D + i[None, :]
            k1 = tl.load(pk, mask=km, other=0.0).to(tl.float32)
            k2 = tl.load(pk + HALF, mask=km, other=0.0).to(tl.float32)
            ty = k_cache_ptr.dtype.element_ty
            tl.store(k_cache_ptr + dst, _sat(k1 * cos - k2 * sin, LIMIT).to(ty), mask=km)
            tl.store(k_cache_ptr + dst + HALF, _sat(k2 * cos + k1 * sin, LIMIT).to(ty), mask=km)
            pv = pk + num_kv_heads * D
            v1 = tl.load(pv, mask=km, other=0.0).to(tl.float32)
            v2 = tl.load(pv + HALF, mask=km, other=0.0).to(tl.float32)
            tl.store(v_cache_ptr + dst, _sat(v1, LIMIT).to(ty), mask=km)
            tl.store(v_cache_ptr + dst + HALF, _sat(v2, LIMIT).to(ty), mask=km)


def _rotate(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """x [T, n, D], cs [T, D/2, 2] -> rotated x (float32)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cs[:, None, :, 0], cs[:, None, :, 1]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_and_cache_ref(qkv, positions, slot_mapping, cos_sin, k_cache, v_cache, num_heads, num_kv_heads):
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
    k_cache[blk, :, off] = clip(_rotate(k[keep], cs[keep])).to(k_cache.dtype)
    v_cache[blk, :, off] = clip(v[keep].float()).to(v_cache.dtype)


def rope_and_cache(qkv, positions, slot_mapping, cos_sin, k_cache, v_cache, num_heads: int, num_kv_heads: int) -> None:
    """Rotates q in place inside `qkv`; writes rotated k and v into the caches."""
    if not use_triton(qkv):
        return rope_and_cache_ref(qkv, positions, slot_mapping, cos_sin, k_cache, v_cache, num_heads, num_kv_heads)
    D = k_cache.shape[-1]
    assert qkv.stride(1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    _rope_cache_kernel[(qkv.shape[0],)](
        qkv,
        positions,
        slot_mapping,
        cos_sin,
        k_cache,
        v_cache,
        qkv.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        num_heads,
        num_kv_heads,
        HALF=D // 2,
        H_PAD=next_pow2(num_heads),
        KVH_PAD=next_pow2(num_kv_heads),
        BLOCK_SIZE=k_cache.shape[2],
        LIMIT=saturation(k_cache.dtype),
        num_warps=4,
    )
