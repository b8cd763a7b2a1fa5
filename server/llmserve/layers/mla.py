"""Multi-head latent attention (DeepSeek-V2/V3) over the paged KV cache.

Per token, the keys and values of all heads are one compressed latent c (`kv_lora_rank` wide, after
kv_a_layernorm) and one rotary key k_r shared by the heads (`qk_rope_head_dim`), both from
kv_a_proj_with_mqa. Head h's key is [W_uk[h] c, k_r] and its value W_uv[h] c, with W_uk / W_uv the two halves
of kv_b_proj. The cache keeps only the row [c | k_r] (kv_cache.py: one plane, one "head").

Two equal ways to attend to it (`paged_mla_attention`):
- expanded (prefill chunks): the context's c is up-projected to per-head keys and values, and attention
  runs as ordinary MHA of width qk_nope + qk_rope. Its cost grows with the context times kv_b_proj, once
  per chunk, which a long chunk of queries amortises.
- absorbed (decode, and short chunks such as speculation's): W_uk is folded into the query,
  q_lat[h] = [q_nope[h] W_uk[h], q_rope[h]], so every head attends the cached rows themselves (MQA with
  keys of kv_lora + rope and values their first kv_lora features), and W_uv is applied to the
  kv_lora-wide output. Nothing per context token is recomputed.

Where each runs: on CUDA (unless the `ref` kernel switch is on) the absorbed chunks of up to MLA_MAX_Q = 8
queries go through kernels/mla_decode.py, one launch for the step (W_uk and W_uv as batched products in the
weights' dtype around it); a decode step (one query a chunk, T == B) needs no host sync, and a CUDA graph's
uniform layout none either (`kernel_q_tile`). A step with longer chunks looks at cu_q once and runs those in
torch (`paged_mla_attention_ref`). That torch path, chunk by chunk with `latent_attention` or
`expanded_attention`, syncing with the host, is the reference, and the CPU's path.

Rotary: DeepSeek rotates adjacent pairs (x0, x1), (x2, x3)...; the pairs are gathered into halves first
([x0, x2, ... | x1, x3, ...], as transformers' V3 does), so one rotate-half formula serves both layouts.
q and k are permuted alike, so their products are those of the reference. Under YaRN, cos and sin carry
its attention factor and the softmax scale its mscale (layers/rope.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from llmserve.kernels import use_triton
from llmserve.kernels.attention import AttnMeta
from llmserve.kernels.cache_rows import store_rows
from llmserve.kernels.mla_decode import MLA_MAX_Q, mla_decode
from llmserve.kernels.mla_decode import fits as mla_decode_fits
from llmserve.kernels.norm import rms_norm
from llmserve.layers.deepseek_config import NORM_EPS, MLAConfig
from llmserve.layers.kv_cache import LayerKV
from llmserve.layers.linear import Linear
from llmserve.layers.quant.methods import LinearMethod, load_linear
from llmserve.layers.weights import WeightReader

# Chunks of at most this many query tokens attend in the absorbed form (decode, speculation's verification).
ABSORB_MAX_Q = 8


def dense_weight(linear: Linear, in_features: int, like: torch.Tensor) -> torch.Tensor:
    """W [out, in] in float32 of any format's `Linear` (its product of the identity): the absorbed form
    needs kv_b_proj's matrix itself, quantized or not."""
    eye = torch.eye(in_features, dtype=like.dtype, device=like.device)
    return linear(eye, torch.float32).T.contiguous()


@dataclass
class MLAWeights:
    q_a_kv_a: Linear  # hidden -> [q_lora |] kv_lora + rope: q_a_proj and kv_a_proj_with_mqa fused
    q_a_norm: torch.Tensor | None  # q LoRA's norm, with q_b below; None: q_proj instead
    q: Linear  # q_b_proj (q_lora -> H * qk_head_dim) or q_proj (hidden -> H * qk_head_dim)
    kv_a_norm: torch.Tensor
    w_uk: torch.Tensor  # [H, qk_nope, kv_lora] in the model's dtype: kv_b_proj's key half
    w_uv: torch.Tensor  # [H, v_head, kv_lora]: its value half
    o: Linear


def load_mla(
    r: WeightReader, p: str, method: LinearMethod, cfg: MLAConfig, num_heads: int, heads: tuple[int, int] | None = None
) -> MLAWeights:
    """One layer's attention weights under `p` (e.g. "model.layers.3.self_attn."); `heads`: only the query heads
    [first, last) of the `num_heads` (a tensor-parallel rank's: its rows of q and kv_b, its columns of o; the
    latent projections are every rank's, and o's output a partial sum)."""
    lora = cfg.q_lora_rank is not None
    a = [(p + "q_a_proj.", None)] if lora else []
    h0, h1 = heads or (0, num_heads)
    q_rows = (0, h0 * cfg.qk_head_dim, h1 * cfg.qk_head_dim) if heads else None
    o_cols = (1, h0 * cfg.v_head_dim, h1 * cfg.v_head_dim) if heads else None
    kv_b = load_linear(method, r, (p + "kv_b_proj.", None))
    if kv_b.bias is not None or kv_b.parts is not None:
        raise ValueError(f"{p}kv_b_proj: a bias or a split projection cannot be absorbed")
    like = r.get(p + "kv_a_layernorm.weight")
    w = dense_weight(kv_b, cfg.kv_lora_rank, like).to(like.dtype)
    w = w.view(num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)[h0:h1]
    return MLAWeights(
        q_a_kv_a=load_linear(method, r, *a, (p + "kv_a_proj_with_mqa.", None)),
        q_a_norm=r.get(p + "q_a_layernorm.weight") if lora else None,
        q=load_linear(method, r, (p + ("q_b_proj." if lora else "q_proj."), q_rows)),
        kv_a_norm=like,
        w_uk=w[:, : cfg.qk_nope_head_dim].contiguous(),
        w_uv=w[:, cfg.qk_nope_head_dim :].contiguous(),
        o=load_linear(method, r, (p + "o_proj.", o_cols)),
    )


def rotate(x: torch.Tensor, cos_sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [T, ..., R] rotated by cos_sin [T, R/2, 2] (one row per token), as rotate-half halves (module doc)."""
    x = x.float()
    if interleaved:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1] // 2,)
    cos, sin = cos_sin[..., 0].reshape(shape), cos_sin[..., 1].reshape(shape)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def latent_attention(
    q_lat: torch.Tensor, rows: torch.Tensor, q_pos: torch.Tensor, scale: float, latent_dim: int
) -> torch.Tensor:
    """The absorbed inner attention of one chunk: q_lat [q, H, L + R] over its context's cached rows
    [kv, L + R] (keys; their first L features the values), causal by position -> [q, H, L] float32."""
    s = torch.einsum("thd,kd->htk", q_lat, rows) * scale
    s = s.masked_fill(torch.arange(rows.shape[0], device=rows.device) > q_pos[None, :, None], float("-inf"))
    return torch.einsum("htk,kl->thl", s.softmax(-1), rows[:, :latent_dim])


def expanded_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    rows: torch.Tensor,
    q_pos: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same attention in MHA form: the context's latents up-projected to per-head keys and values
    -> [q, H, v_head] float32."""
    L = w_uk.shape[-1]
    lat, k_rope = rows[:, :L], rows[:, L:]
    k_nope = torch.einsum("kl,hnl->khn", lat, w_uk)
    v = torch.einsum("kl,hvl->khv", lat, w_uv)
    s = torch.einsum("thn,khn->htk", q_nope, k_nope) + torch.einsum("thr,kr->htk", q_rope, k_rope)
    s = (s * scale).masked_fill(torch.arange(rows.shape[0], device=rows.device) > q_pos[None, :, None], float("-inf"))
    return torch.einsum("htk,khv->thv", s.softmax(-1), v)


def expanded_fused(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    rows: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`expanded_attention` of a chunk that ends its context, through torch's fused attention (flash or
    memory-efficient on CUDA) in rows' dtype: no [H, q, kv] scores in memory. The values are zero-padded
    to the keys' width (the fused kernels take one head width) -> [q, H, v_head] float32."""
    dt, H, L = rows.dtype, w_uk.shape[0], w_uk.shape[-1]
    lat, k_rope = rows[:, :L], rows[:, L:]
    k = torch.cat([torch.einsum("kl,hnl->hkn", lat, w_uk.to(dt)), k_rope[None].expand(H, -1, -1)], dim=-1)
    v = torch.einsum("kl,hvl->hkv", lat, w_uv.to(dt))
    dv = v.shape[-1]
    assert dv <= k.shape[-1], "values wider than keys"
    v = F.pad(v, (0, k.shape[-1] - dv))
    q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1).to(dt)
    mask = causal_lower_right(q.shape[1], k.shape[1])  # query i sits at kv_len - q + i
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale)
    return o[0, :, :, :dv].transpose(0, 1).float()


def chunk_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    meta: AttnMeta,
    b: int,
    q0: int,
    q1: int,
    kv_len: int,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    absorb_max_q: int,
) -> torch.Tensor:
    """Chunk b (queries q0:q1 of the batch, kv_len cached rows) in torch -> [q1 - q0, H, v_head] float32:
    absorbed up to `absorb_max_q` queries, expanded beyond (w_uk, w_uv in float32)."""
    bs, L = cache.shape[2], w_uk.shape[-1]
    pos = torch.arange(kv_len, device=cache.device)
    rows = cache[meta.block_tables[b, pos // bs].long(), 0, pos % bs]  # [kv_len, L + R]
    if q1 - q0 > absorb_max_q and use_triton(cache):  # CUDA's fused attention (the ref switch: the einsums)
        return expanded_fused(q_nope[q0:q1], q_rope[q0:q1], rows, w_uk, w_uv, scale)
    rows = rows.float()
    q_pos = torch.arange(kv_len - (q1 - q0), kv_len, device=cache.device)
    qn, qr = q_nope[q0:q1].float(), q_rope[q0:q1].float()
    if q1 - q0 > absorb_max_q:
        return expanded_attention(qn, qr, rows, q_pos, w_uk, w_uv, scale)
    q_lat = torch.cat([torch.einsum("thn,hnl->thl", qn, w_uk), qr], dim=-1)
    return torch.einsum("thl,hvl->thv", latent_attention(q_lat, rows, q_pos, scale, L), w_uv)


def paged_mla_attention_ref(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    meta: AttnMeta,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    absorb_max_q: int = ABSORB_MAX_Q,
    chunks: list[int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_mla_attention` in torch, chunk by chunk, syncing with the host: the reference, the CPU's path
    and long chunks' (`chunks`: only those, into `out`)."""
    T, H, _ = q_nope.shape
    w_uk, w_uv = w_uk.float(), w_uv.float()
    out = q_nope.new_zeros(T, H, w_uv.shape[1], dtype=torch.float32) if out is None else out
    cu, lens = meta.cu_q.tolist(), meta.seq_lens.tolist()
    for b in range(len(lens)) if chunks is None else chunks:
        q0, q1 = cu[b], cu[b + 1]
        if q1 > q0 and lens[b] > 0:
            out[q0:q1] = chunk_attention(
                q_nope, q_rope, cache, meta, b, q0, q1, lens[b], w_uk, w_uv, scale, absorb_max_q
            )
    return out


def kernel_q_tile(T: int, meta: AttnMeta, kmax: int) -> tuple[int, list[int]]:
    """(most queries of a chunk the kernel takes, the chunks it leaves to torch), syncing only when the
    shapes cannot tell: every chunk has a query (the runner's steps), so none has more than T - B + 1; a
    CUDA graph's layout gives each T / B; else one look at cu_q."""
    B = meta.seq_lens.shape[0]
    if T - B + 1 <= kmax:
        return max(1, T - B + 1), []
    if meta.seq_lens.is_cuda and torch.cuda.is_current_stream_capturing():
        if T % B or T // B > kmax:
            raise RuntimeError(f"MLA decode graph: {T} queries over {B} chunks, more than {kmax} a chunk")
        return T // B, []
    q_lens = (meta.cu_q[1:] - meta.cu_q[:-1]).tolist()
    short = [n for n in q_lens if n <= kmax]
    return max(short, default=1), [b for b, n in enumerate(q_lens) if n > kmax]


def paged_mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    meta: AttnMeta,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    absorb_max_q: int = ABSORB_MAX_Q,
) -> torch.Tensor:
    """q_nope [T, H, nope], q_rope [T, H, R] (rotated) over the cached rows (`cache` [blocks, 1, bs, L + R],
    this step's already written) -> [T, H, v_head] float32: absorbed for chunks of up to `absorb_max_q`
    queries (on the decode kernel where it runs), expanded for longer ones (module doc)."""
    T, H, _ = q_nope.shape
    L, R = w_uk.shape[-1], q_rope.shape[-1]
    kmax = min(absorb_max_q, MLA_MAX_Q)
    if kmax < 1 or T == 0 or not use_triton(cache) or not mla_decode_fits(L, R, cache):
        return paged_mla_attention_ref(q_nope, q_rope, cache, meta, w_uk, w_uv, scale, absorb_max_q)
    q_tile, rest = kernel_q_tile(T, meta, kmax)
    if len(rest) == meta.seq_lens.shape[0]:  # no chunk for the kernel (a prefill step)
        return paged_mla_attention_ref(q_nope, q_rope, cache, meta, w_uk, w_uv, scale, absorb_max_q)
    # Absorb W_uk, and later apply W_uv, per head as batched products in the weights' dtype.
    q_abs = torch.bmm(q_nope.transpose(0, 1).to(w_uk.dtype), w_uk).transpose(0, 1)
    q_lat = torch.cat([q_abs.to(cache.dtype), q_rope.to(cache.dtype)], dim=-1)
    o_lat = mla_decode(q_lat, cache, meta, scale, L, q_tile)
    out = torch.bmm(o_lat.transpose(0, 1).to(w_uv.dtype), w_uv.transpose(1, 2)).transpose(0, 1).float()
    if rest:  # chunks longer than the kernel takes
        paged_mla_attention_ref(q_nope, q_rope, cache, meta, w_uk, w_uv, scale, absorb_max_q, rest, out)
    return out


class MLAttention:
    """One layer's MLA: projections, rotary, the cache write and the attention (module doc)."""

    def __init__(self, w: MLAWeights, cfg: MLAConfig, num_heads: int, scale: float, cos_sin: torch.Tensor) -> None:
        self.w, self.cfg, self.num_heads, self.scale = w, cfg, num_heads, scale
        self.cos_sin = cos_sin  # [max_pos, R/2, 2] float32, YaRN's attention factor included
        self.absorb_max_q = ABSORB_MAX_Q

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        meta: AttnMeta,
        kv: LayerKV,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """Normed hidden states x [T, hidden] -> the attention's output projection [T, hidden]; writes this
        step's rows [c | k_r] into the layer's cache (kv[0], [blocks, 1, bs, L + R]) first."""
        c, w = self.cfg, self.w
        T, H, L = x.shape[0], self.num_heads, c.kv_lora_rank
        a = w.q_a_kv_a(x, torch.float32)
        if w.q_a_norm is not None:
            q_in = rms_norm(a[:, : c.q_lora_rank].contiguous(), w.q_a_norm, NORM_EPS)
            a = a[:, c.q_lora_rank :]
        else:
            q_in = x
        q = w.q(q_in, torch.float32).view(T, H, c.qk_head_dim)
        cs = self.cos_sin[positions.long()]
        q_rope = rotate(q[..., c.qk_nope_head_dim :], cs, c.rope_interleave)
        latent = rms_norm(a[:, :L].contiguous(), w.kv_a_norm.float(), NORM_EPS)
        k_rope = rotate(a[:, L:], cs, c.rope_interleave)
        cache = kv[0]
        store_rows(torch.cat([latent, k_rope], dim=-1), slot_mapping, cache)
        out = paged_mla_attention(
            q[..., : c.qk_nope_head_dim], q_rope, cache, meta, w.w_uk, w.w_uv, self.scale, self.absorb_max_q
        )
        return w.o(out.reshape(T, H * c.v_head_dim).to(x.dtype), out_dtype)
