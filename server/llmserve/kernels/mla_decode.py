"""MLA's absorbed decode attention (layers/mla.py) over the paged latent cache, as a Triton kernel.

Every head of a chunk attends the same cached rows [c | k_r] (MQA: keys L + R wide, values their first L
features), with queries q_lat [T, H, L + R] that carry W_uk already. A program takes BLOCK_H heads times the
chunk's (up to Q_TILE) queries as the M rows of its tiles and walks a range of the context BLOCK_N rows a
step: s = q_lat . k^T as two products (latent and rope parts, each a power of two wide) and acc += p . k[:, :L]
from the same tile in shared memory, so a row is read once per head block. The head blocks of one
(chunk, split) are neighbouring program ids (axis 0), so they run together and all but the first read the
tile from L2: HBM sees each row about once per chunk.

Split-K (flash decoding): the grid has `max_splits` programs per (head block, chunk), fixed by the batch's
shape (graph-capturable: nothing depends on the lengths on the host). A chunk uses as many of them as its
length asks, at least `min_split` rows each (the partials of H heads, H * L floats written and read per
split, must stay small against the rows they save); the rest return at once. A chunk with one split writes
its output directly; the others leave partial outputs and log2-sum-exps that `_merge_kernel` weighs.

Chunks of more than Q_TILE queries are not this kernel's: their rows of the output are left unwritten, for
the caller's torch path. A chunk with no context (a CUDA graph's padding) gets zeros. Causal by position:
query i of a chunk of n sits at kv_len - n + i.

Precision: q_lat and the softmax weights p are rounded to the cache's dtype for the tensor-core products
(fp32 accumulation, fp32 softmax statistics), as kernels/attention.py does; the output has `out_dtype`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from llmserve.kernels import next_pow2
from llmserve.kernels.attention import LOG2E, AttnMeta

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU wheel of torch ships without triton
    triton = None

MLA_MAX_Q = 8  # most queries of one chunk a program takes (speculation's verification: <= 8)
MAX_SPLITS = 16
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Launch:
    """One program's shape: heads x queries (the M rows of its products), context rows a step."""

    block_h: int
    q_tile: int
    block_n: int
    num_warps: int
    num_stages: int


def launch_shape(num_heads: int, q_tile: int) -> Launch:
    """Up to 64 rows a program (V3's 128 heads: two head blocks a chunk). 64 rows x L = 512 of fp32
    accumulator take 128 registers a thread at 8 warps; the tile [BLOCK_N, 576] in bf16 is 36 KB at
    BLOCK_N = 32 (two stages and the 72 KB query in shared memory fit sm90's 227 KB); fewer rows (V2-Lite's
    16 heads) leave room for 64-row tiles at 4 warps."""
    q_tile = next_pow2(q_tile)
    heads = max(next_pow2(num_heads), 16 // q_tile)  # tl.dot needs M >= 16
    block_h = min(heads, max(1, 64 // q_tile))
    if block_h * q_tile >= 64:
        return Launch(block_h, q_tile, block_n=32, num_warps=8, num_stages=2)
    return Launch(block_h, q_tile, block_n=64, num_warps=4, num_stages=2)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_plan(batch: int, head_blocks: int, num_heads: int, device: torch.device) -> tuple[int, int]:
    """(max_splits, min_split): enough programs to fill the GPU twice over, and at least 32 rows per head
    in a split (its partials, H x L x 8 bytes, stay under ~10% of the rows' L + R bf16 bytes)."""
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 4
    max_splits = min(MAX_SPLITS, max(1, -(-2 * sms // (batch * head_blocks))))
    return max_splits, max(256, 32 * num_heads)


def fits(latent_dim: int, rope_dim: int, cache: torch.Tensor) -> bool:
    """Whether the kernel serves this cache (unquantized; the rope part at least one 16-wide dot step)."""
    return triton is not None and cache.dtype in CACHE_DTYPES and latent_dim >= 16 and rope_dim >= 1


if triton is not None:

    @triton.jit
    def _rows(ptr, row, d, ok, WIDTH: tl.constexpr, PAD: tl.constexpr):
        """Rows ptr + row[i] of WIDTH features (d: arange(0, PAD)), zeros where not ok or past WIDTH."""
        if PAD == WIDTH:
            return tl.load(ptr + row[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        else:
            return tl.load(ptr + row[:, None] + d[None, :], mask=ok[:, None] & (d < WIDTH)[None, :], other=0.0)

    @triton.jit
    def _chunk(cu_q_ptr, seq_lens_ptr, b, max_splits, min_split, Q_TILE: tl.constexpr):
        """Chunk b's first query, its queries (0 when longer than Q_TILE: not ours), context and splits."""
        q0 = tl.load(cu_q_ptr + b)
        q_len = tl.load(cu_q_ptr + b + 1) - q0
        q_len = tl.where(q_len <= Q_TILE, q_len, 0)
        kv_len = tl.load(seq_lens_ptr + b)
        n_split = tl.minimum(max_splits, tl.maximum(1, tl.cdiv(kv_len, min_split)))
        return q0, q_len, kv_len, n_split

    @triton.jit(do_not_specialize=["max_splits", "min_split", "stride_bt", "stride_pt", "stride_lt"])
    def _mla_decode_kernel(
        q_ptr,
        c_ptr,
        out_ptr,
        po_ptr,
        pl_ptr,
        bt_ptr,
        seq_lens_ptr,
        cu_q_ptr,
        scale,
        num_heads,
        max_splits,
        min_split,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_cb,
        stride_bt,
        stride_ps,
        stride_pt,
        stride_ls,
        stride_lt,
        LATENT: tl.constexpr,
        L_PAD: tl.constexpr,
        ROPE: tl.constexpr,
        R_PAD: tl.constexpr,
        BLOCK_H: tl.constexpr,
        Q_TILE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        hb = tl.program_id(0)
        b = tl.program_id(1)
        split = tl.program_id(2)
        q0, q_len, kv_len, n_split = _chunk(cu_q_ptr, seq_lens_ptr, b, max_splits, min_split, Q_TILE)
        per = tl.cdiv(tl.cdiv(kv_len, n_split), BLOCK_N) * BLOCK_N
        lo = split * per
        hi = tl.where((split < n_split) & (q_len > 0), tl.minimum(kv_len, lo + per), lo)  # else no work

        M: tl.constexpr = BLOCK_H * Q_TILE
        r = tl.arange(0, M)
        tok = r % Q_TILE
        head = hb * BLOCK_H + r // Q_TILE
        row_ok = (tok < q_len) & (head < num_heads)
        t64 = (q0 + tok).to(tl.int64)
        dl = tl.arange(0, L_PAD)
        dr = tl.arange(0, R_PAD)
        q_row = t64 * stride_qt + head * stride_qh
        qn = _rows(q_ptr, q_row, dl, row_ok, LATENT, L_PAD).to(c_ptr.dtype.element_ty)
        qr = _rows(q_ptr + LATENT, q_row, dr, row_ok, ROPE, R_PAD).to(c_ptr.dtype.element_ty)
        q_pos = kv_len - q_len + tok

        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, L_PAD], tl.float32)
        n = tl.arange(0, BLOCK_N)
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        for start in range(lo, hi, BLOCK_N):
            pos = start + n
            pos_ok = pos < hi
            blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0)
            row = blk.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * (LATENT + ROPE)
            kn = _rows(c_ptr, row, dl, pos_ok, LATENT, L_PAD)
            kr = _rows(c_ptr + LATENT, row, dr, pos_ok, ROPE, R_PAD)
            s = tl.dot(qr, tl.trans(kr))
            s = tl.dot(qn, tl.trans(kn), s) * scale
            s = tl.where(pos_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(kn.dtype), kn, acc * alpha[:, None])
            m_i = m_new

        d_ok = dl < LATENT
        direct = (n_split == 1) & (split == 0)  # one split: the final output, no merge
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o = out_ptr + t64[:, None] * stride_ot + head[:, None] * stride_oh + dl[None, :]
        tl.store(o, out.to(out_ptr.dtype.element_ty), mask=(row_ok & direct)[:, None] & d_ok[None, :])
        part = row_ok & (split < n_split) & (n_split > 1)
        po = po_ptr + split.to(tl.int64) * stride_ps + t64[:, None] * stride_pt + head[:, None] * LATENT + dl[None, :]
        tl.store(po, out, mask=part[:, None] & d_ok[None, :])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(pl_ptr + split.to(tl.int64) * stride_ls + t64 * stride_lt + head, lse, mask=part)

    @triton.jit(do_not_specialize=["max_splits", "min_split", "stride_pt", "stride_lt"])
    def _merge_kernel(
        po_ptr,
        pl_ptr,
        out_ptr,
        seq_lens_ptr,
        cu_q_ptr,
        num_heads,
        max_splits,
        min_split,
        stride_ps,
        stride_pt,
        stride_ls,
        stride_lt,
        stride_ot,
        stride_oh,
        LATENT: tl.constexpr,
        L_PAD: tl.constexpr,
        Q_TILE: tl.constexpr,
        S_PAD: tl.constexpr,
    ):
        """One (query, head): the partials of its chunk's splits weighed by their share of the softmax."""
        b = tl.program_id(0) // Q_TILE
        i = tl.program_id(0) % Q_TILE
        h = tl.program_id(1)
        q0, q_len, kv_len, n_split = _chunk(cu_q_ptr, seq_lens_ptr, b, max_splits, min_split, Q_TILE)
        active = (i < q_len) & (n_split > 1)
        t = (q0 + i).to(tl.int64)
        s = tl.arange(0, S_PAD)
        s_ok = (s < n_split) & active
        lse = tl.load(pl_ptr + s * stride_ls + t * stride_lt + h, mask=s_ok, other=float("-inf"))
        mx = tl.max(lse, axis=0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w = tl.exp2(lse - mx)
        w = w / tl.maximum(tl.sum(w, axis=0), 1e-30)
        d = tl.arange(0, L_PAD)
        d_ok = d < LATENT
        po = tl.load(
            po_ptr + s[:, None] * stride_ps + t * stride_pt + h * LATENT + d[None, :],
            mask=s_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        o = tl.sum(po * w[:, None], axis=0)
        tl.store(out_ptr + t * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok & active)


def mla_decode(
    q_lat: torch.Tensor,
    cache: torch.Tensor,
    meta: AttnMeta,
    scale: float,
    latent_dim: int,
    q_tile: int = 1,
    out_dtype: torch.dtype | None = None,
    splits: tuple[int, int] | None = None,
    shape: Launch | None = None,
) -> torch.Tensor:
    """q_lat [T, H, L + R] (last dim contiguous) over `cache` [blocks, 1, block_size, L + R] (contiguous)
    -> [T, H, L] in `out_dtype` (default the cache's), for the chunks of at most `q_tile` queries (a static
    bound: 1 for a decode step); rows of longer chunks are left unwritten (module doc). No host sync.
    `splits` (max_splits, min_split) and `shape`: instead of `split_plan`'s and `launch_shape`'s (tests, lab)."""
    T, H, D = q_lat.shape
    B = meta.seq_lens.shape[0]
    L, R, bs = latent_dim, D - latent_dim, cache.shape[2]
    assert cache.shape[1] == 1 and cache.shape[3] == D and cache.is_contiguous() and q_lat.stride(2) == 1
    assert 1 <= q_tile <= MLA_MAX_Q and fits(L, R, cache)
    out = torch.empty(T, H, L, dtype=out_dtype or cache.dtype, device=q_lat.device)
    if T == 0 or B == 0:
        return out
    shape = shape or launch_shape(H, q_tile)
    head_blocks = -(-H // shape.block_h)
    S, min_split = splits or split_plan(B, head_blocks, H, q_lat.device)
    po = torch.empty(S, T, H, L, dtype=torch.float32, device=q_lat.device) if S > 1 else out
    pl = torch.empty(S, T, H, dtype=torch.float32, device=q_lat.device) if S > 1 else out
    L_PAD, R_PAD = max(16, next_pow2(L)), max(16, next_pow2(R))
    _mla_decode_kernel[(head_blocks, B, S)](
        q_lat, cache, out, po, pl, meta.block_tables, meta.seq_lens, meta.cu_q,
        scale * LOG2E, H, S, min_split,
        q_lat.stride(0), q_lat.stride(1), out.stride(0), out.stride(1), cache.stride(0), meta.block_tables.stride(0),
        po.stride(0) if S > 1 else 0, po.stride(1) if S > 1 else 0,
        pl.stride(0) if S > 1 else 0, pl.stride(1) if S > 1 else 0,
        LATENT=L, L_PAD=L_PAD, ROPE=R, R_PAD=R_PAD, BLOCK_H=shape.block_h, Q_TILE=shape.q_tile,
        BLOCK_N=shape.block_n, BLOCK_SIZE=bs, num_warps=shape.num_warps, num_stages=shape.num_stages,
    )  # fmt: skip
    if S > 1:
        _merge_kernel[(B * shape.q_tile, H)](
            po, pl, out, meta.seq_lens, meta.cu_q, H, S, min_split,
            po.stride(0), po.stride(1), pl.stride(0), pl.stride(1), out.stride(0), out.stride(1),
            LATENT=L, L_PAD=L_PAD, Q_TILE=shape.q_tile, S_PAD=max(2, next_pow2(S)), num_warps=4,
        )  # fmt: skip
    return out
