"""Attention over the paged KV cache for a packed mixed batch.

One launch serves every chunk of a step: prefill chunks (causal among their
own tokens, attending to the cached prefix) and decode tokens alike. The KV
cache of a layer is `[num_blocks, KVH, block_size, D]`; chunk b's key at
position p lives in block `block_tables[b, p // block_size]`.

Grid: (work item, KV head, split). A work item is BLOCK_T query tokens of one
chunk; its tile holds those tokens times the GROUP query heads that share the
KV head, so each K/V tile is read once for the whole group (GQA). Decode-only
batches with few sequences split each context over `num_splits` programs
(split-KV) and merge the partial results by their log-sum-exp (attention_merge.py), so a batch of
one still spreads over the GPU.

Precision: q arrives in fp32 (the model keeps it unrounded) and is rounded
to the cache's dtype for the tensor-core products, as are the softmax weights
p. The runner keeps a bf16 model's cache in fp16 (11 significant bits against
bf16's 8, the same bytes), so q, k, v and p each lose less than a bf16 value
would, at no cost in the loop (`scripts/lab/bench_precision.py`, docs/gpu.md).
fp16's range suffices: kernels/rotary.py saturates q, k and v at +-65504 when
it writes them (values never seen in practice, but never inf), and p is in
[0, 1]. The output has the model's dtype, for the output projection.

Quantized cache (int8 or fp8 E4M3, with float32 scales k_scale, v_scale
`[num_blocks, KVH, block_size]`, one per token and KV head, see rotary.py):
tiles are dequantized in registers, inside a constexpr branch (QUANT), so the
fp16 path compiles as before. Products run in fp16 (int8 and E4M3 values are
exact in it): scores = (q . k_q^T) * k_scale[None, :] (the token's scale, with
the softmax scale, on each score column after the dot), and
p @ (v_q * v_scale[:, None]) = (p * v_scale[None, :]) @ v_q. Deviation: the
weights are p * (v_scale / c) with c the tile's largest v scale, and the
accumulator is kept in units of c (rescaled with alpha when c changes; times
c at the end). They stay in [0, 1] like p, so their fp16 rounding is p's; p *
v_scale itself would be about v's absmax / 127 times smaller and fall into
fp16's subnormals (< 6.1e-5, fewer significant bits) for small-valued heads:
emulated over 2048 keys, D = 128, int8 V of absmax 0.01 (0.001), the output's
relative error is 7e-3 (5e-2) that way against 2e-4 normalized, as for |v| ~ 1.
The cost: a 64-wide max and a division per tile, and registers: compiled for
sm90 (H 32, KVH 8, D 128), the int8 decode launches take 186-196 a thread
against 151 without it (122 over fp16), 255 for prefill tiles either way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from llmserve.kernels import next_pow2, use_triton
from llmserve.kernels.attention_merge import merge_splits
from llmserve.kernels.pdl import launch_args, pdl_on
from llmserve.kernels.rotary import QUANT_MAX

try:
    import triton
    import triton.language as tl

    from llmserve.kernels.pdl import pdl_launch_next, pdl_wait
except ImportError:  # pragma: no cover
    triton = None

LOG2E = 1.4426950408889634


@dataclass
class AttnMeta:
    """Per-step attention layout (device tensors, int32)."""

    cu_q: torch.Tensor  # [B+1] offsets of each chunk's tokens in the packed batch
    seq_lens: torch.Tensor  # [B] tokens in the cache once this step's are written (context + chunk)
    block_tables: torch.Tensor  # [B, max_blocks]
    item_seq: torch.Tensor  # [I] chunk of each work item
    item_qstart: torch.Tensor  # [I] first query token (within its chunk) of each work item
    block_t: int  # query tokens per work item
    num_splits: int = 1
    # Mixed batches: decode chunks get their own launch with small tiles (a 1-token
    # chunk in a 128-row prefill tile would waste 31/32 of its matrix work).
    dec_item_seq: torch.Tensor | None = None
    dec_item_qstart: torch.Tensor | None = None
    dec_block_t: int = 0


def group_pad(num_heads: int, num_kv_heads: int) -> int:
    return next_pow2(num_heads // num_kv_heads)


@dataclass(frozen=True)
class Tile:
    """Launch shape of one kind of work item: query rows (tokens x GROUP_PAD), keys per loop step."""

    rows: int
    block_n: int
    num_warps: int
    num_stages: int


DECODE_TILE = Tile(rows=16, block_n=64, num_warps=4, num_stages=2)
# Prefill: 128 keys a step, 3 stages where shared memory takes them (sm90's 227 KB). On an H200
# (scripts/lab/bench_attention.py) this is the fastest shape or within 2% of it on every case, and 7-18%
# faster than 64 keys and 2 stages, the shape for GPUs with less shared memory.
PREFILL_TILE = Tile(rows=128, block_n=128, num_warps=8, num_stages=3)
SMALL_SMEM_PREFILL_TILE = Tile(rows=128, block_n=64, num_warps=8, num_stages=2)


@functools.cache
def _big_smem(device_index: int) -> bool:
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin >= 200 * 1024


def _prefill_tile(device_index: int) -> Tile:
    return PREFILL_TILE if _big_smem(device_index) else SMALL_SMEM_PREFILL_TILE


def tile_tokens(num_heads: int, num_kv_heads: int, decode_only: bool) -> int:
    """BLOCK_T: query tokens per program; the tile has BLOCK_T * GROUP_PAD rows (>= 16 for tl.dot)."""
    gp = group_pad(num_heads, num_kv_heads)
    rows = DECODE_TILE.rows if decode_only else PREFILL_TILE.rows
    return max(1, rows // gp)


if triton is not None:

    @triton.jit(do_not_specialize=["num_splits", "stride_bt", "stride_pt", "stride_lt"])
    def _paged_attn_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        ks_ptr,
        vs_ptr,
        out_ptr,
        po_ptr,
        pl_ptr,
        bt_ptr,
        seq_lens_ptr,
        cu_q_ptr,
        item_seq_ptr,
        item_qstart_ptr,
        scale,
        num_splits,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_cb,
        stride_ch,
        stride_sb,
        stride_sh,
        stride_bt,
        stride_ps,
        stride_pt,
        stride_ls,
        stride_lt,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        SPLIT: tl.constexpr,
        QUANT: tl.constexpr,  # an int8/fp8 cache, with scales
        PDL: tl.constexpr,  # launched with PDL (pdl.py)
    ):
        pdl_wait(PDL)
        pdl_launch_next(PDL)
        item = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq = tl.load(item_seq_ptr + item)
        qt0 = tl.load(item_qstart_ptr + item)
        q_begin = tl.load(cu_q_ptr + seq)
        q_len = tl.load(cu_q_ptr + seq + 1) - q_begin
        kv_len = tl.load(seq_lens_ptr + seq)
        ctx = kv_len - q_len

        M: tl.constexpr = BLOCK_T * GROUP_PAD
        r = tl.arange(0, M)
        tok = qt0 + r // GROUP_PAD
        g = r % GROUP_PAD
        row_ok = (tok < q_len) & (g < GROUP)
        head = kvh * GROUP + g
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        tok64 = (q_begin + tok).to(tl.int64)
        q = tl.load(
            q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if QUANT:
            q = q.to(tl.float16)
        else:
            q = q.to(k_ptr.dtype.element_ty)
        q_pos = ctx + tok

        kv_end = tl.minimum(kv_len, ctx + qt0 + BLOCK_T)  # causal: no key past the tile's last query
        lo = 0
        hi = kv_end
        if SPLIT:
            per = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
            lo = split * per
            hi = tl.minimum(kv_end, lo + per)

        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D_PAD], tl.float32)
        n = tl.arange(0, BLOCK_N)
        base = kvh.to(tl.int64) * stride_ch
        if QUANT:
            sbase = kvh.to(tl.int64) * stride_sh
            c = tl.full((), 1.0, tl.float32)  # acc's unit (see the docstring)
        for start in range(lo, hi, BLOCK_N):
            pos = start + n
            pos_ok = pos < hi
            blk = tl.load(bt_ptr + seq.to(tl.int64) * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
            off = base + blk.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * HEAD_DIM
            kv_mask = pos_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if QUANT:
                soff = sbase + blk.to(tl.int64) * stride_sb + pos % BLOCK_SIZE
                ks = tl.load(ks_ptr + soff, mask=pos_ok, other=0.0)
                s = tl.dot(q, tl.trans(k.to(tl.float16))) * (ks * scale)[None, :]
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(pos_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if QUANT:
                vs = tl.load(vs_ptr + soff, mask=pos_ok, other=0.0)
                c_new = tl.max(vs, axis=0)
                c_new = tl.where(c_new > 0.0, c_new, c)
                inv_c = 1.0 / c_new
                pv = (p * (vs * inv_c)[None, :]).to(tl.float16)
                acc = tl.dot(pv, v.to(tl.float16), acc * (alpha * (c * inv_c))[:, None])
                c = c_new
            else:
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new

        if QUANT:
            acc = acc * c
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_mask = row_ok[:, None] & d_ok[None, :]
        if SPLIT:
            po = (
                po_ptr
                + split.to(tl.int64) * stride_ps
                + tok64[:, None] * stride_pt
                + head[:, None] * HEAD_DIM
                + d[None, :]
            )
            tl.store(po, out, mask=o_mask)
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
            tl.store(pl_ptr + split.to(tl.int64) * stride_ls + tok64 * stride_lt + head, lse, mask=row_ok)
        else:
            o = out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
            tl.store(o, out.to(out_ptr.dtype.element_ty), mask=o_mask)


def paged_attention_ref(
    q, k_cache, v_cache, meta: AttnMeta, scale: float, out_dtype=None, k_scale=None, v_scale=None
) -> torch.Tensor:
    """q [T, H, D] (any strides) -> [T, H, D]; plain softmax attention per chunk, in fp32 (over the
    dequantized K/V, value * scale, of a quantized cache)."""
    T, H, D = q.shape
    kvh = k_cache.shape[1]
    bs = k_cache.shape[2]
    out = torch.zeros(T, H, D, dtype=out_dtype or q.dtype, device=q.device)
    cu = meta.cu_q.tolist()
    lens = meta.seq_lens.tolist()
    for b in range(len(lens)):
        q0, q1, kv_len = cu[b], cu[b + 1], lens[b]
        if q1 == q0 or kv_len == 0:
            continue
        pos = torch.arange(kv_len, device=q.device)
        blk = meta.block_tables[b, pos // bs].long()
        k = k_cache[blk, :, pos % bs].float()  # [kv_len, KVH, D]
        v = v_cache[blk, :, pos % bs].float()
        if k_scale is not None:
            k = k * k_scale[blk, :, pos % bs][..., None]
            v = v * v_scale[blk, :, pos % bs][..., None]
        k = k.repeat_interleave(H // kvh, dim=1)
        v = v.repeat_interleave(H // kvh, dim=1)
        s = torch.einsum("thd,khd->htk", q[q0:q1].float(), k) * scale
        q_pos = torch.arange(kv_len - (q1 - q0), kv_len, device=q.device)
        s = s.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[q0:q1] = torch.einsum("htk,khd->thd", s.softmax(-1), v).to(out.dtype)
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMeta,
    scale: float,
    out_dtype: torch.dtype | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] (fp32 or the cache's dtype) -> [T, H, D] in `out_dtype` (default q's). An int8/fp8
    cache comes with its scales `k_scale`, `v_scale` ([num_blocks, KVH, block_size] float32)."""
    quant = k_cache.dtype in QUANT_MAX
    assert (k_scale is not None) == (v_scale is not None) == quant, "scales go with an int8/fp8 cache"
    if not use_triton(q):
        return paged_attention_ref(q, k_cache, v_cache, meta, scale, out_dtype, k_scale, v_scale)
    T, H, D = q.shape
    kvh, bs = k_cache.shape[1], k_cache.shape[2]
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    if quant:
        assert k_scale.is_contiguous() and v_scale.is_contiguous() and k_scale.shape == k_cache.shape[:3]
    else:
        k_scale = v_scale = k_cache  # not read
    out = torch.empty(T, H, D, dtype=out_dtype or q.dtype, device=q.device)
    group = H // kvh
    gp = next_pow2(group)
    d_pad = max(16, next_pow2(D))
    split = meta.num_splits > 1
    S = meta.num_splits
    if split:
        po = torch.empty(S, T, H, D, dtype=torch.float32, device=q.device)
        pl = torch.empty(S, T, H, dtype=torch.float32, device=q.device)
    else:
        po, pl = out, out  # unused
    pdl = pdl_on(q)
    launches = [(meta.item_seq, meta.item_qstart, meta.block_t)]
    if meta.dec_item_seq is not None and meta.dec_item_seq.shape[0] > 0:
        launches.append((meta.dec_item_seq, meta.dec_item_qstart, meta.dec_block_t))
    for item_seq, item_qstart, block_t in launches:
        if item_seq.shape[0] == 0:
            continue
        if block_t * gp <= DECODE_TILE.rows:
            tile = DECODE_TILE
        else:
            tile = _prefill_tile(q.device.index or 0) if q.is_cuda else SMALL_SMEM_PREFILL_TILE
        _paged_attn_kernel[(item_seq.shape[0], kvh, S)](
            q, k_cache, v_cache, k_scale, v_scale, out, po, pl,
            meta.block_tables, meta.seq_lens, meta.cu_q, item_seq, item_qstart,
            scale * LOG2E, S,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
            k_scale.stride(0) if quant else 0, k_scale.stride(1) if quant else 0,
            meta.block_tables.stride(0),
            po.stride(0) if split else 0, po.stride(1) if split else 0,
            pl.stride(0) if split else 0, pl.stride(1) if split else 0,
            GROUP=group, GROUP_PAD=gp, BLOCK_T=block_t, BLOCK_N=tile.block_n, HEAD_DIM=D, D_PAD=d_pad,
            BLOCK_SIZE=bs, SPLIT=split, QUANT=quant, PDL=pdl, num_warps=tile.num_warps, num_stages=tile.num_stages,
            **launch_args(pdl),
        )  # fmt: skip
    if split:
        merge_splits(po, pl, out, pdl)
    return out
