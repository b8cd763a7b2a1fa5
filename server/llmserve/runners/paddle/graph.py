"""Llama / Qwen2 decoder in Paddle (float32), as a dense reference and as a paged static graph.

One class, two forwards over the same weights:
- `forward_dense(input_ids)`: full causal attention over one whole sequence, no cache.
  Independent attention code (HF-style `repeat_kv`), used by tests as the reference.
- `forward_paged(inputs, caches)`: one engine step over a packed mixed batch (prefill
  chunks + decode tokens) that writes this step's K/V into the paged caches in place and
  attends over them. `build_paged_program` traces it into the static graph that the
  exporter saves; the same code also runs eagerly (dygraph), which tests compare against.
The graph contract (inputs, shapes, attention tiling) is documented in docs/model_format.md.

Weights use Paddle's [in, out] layout with q/k/v and gate/up fused (see `param_shapes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import paddle

from llmserve.layers.model_config import ModelConfig

# Graph inputs besides the caches: (name, shape, dtype). -1 = dynamic.
INPUT_SPECS: list[tuple[str, list[int], str]] = [
    ("input_ids", [-1], "int64"),  # [T] packed tokens of this step
    ("positions", [-1], "int64"),  # [T] position of each token in its sequence
    ("slot_mapping", [-1], "int64"),  # [T] cache row that receives each token's K/V
    ("block_tables", [-1, -1], "int64"),  # [B, MB] KV block ids per sequence (padded with 0)
    ("block_size", [1], "int64"),  # tokens per block
    ("tile_seq", [-1], "int64"),  # [R] sequence (row of block_tables) of each query tile
    ("tile_tok", [-1, -1], "int64"),  # [R, Qc] packed token index of each tile's queries
    ("row_seq", [-1], "int64"),  # [Rd] sequence of each single-query row (decode tokens)
    ("row_tok", [-1, 1], "int64"),  # [Rd, 1] packed token index of each single-query row
    ("out_index", [-1], "int64"),  # [T] each token's row in concat(tile outputs, row outputs)
    ("logits_index", [-1], "int64"),  # [N] packed tokens that get logits
]


def cache_names(num_layers: int) -> list[str]:
    return [f"{kind}_cache_{i}" for i in range(num_layers) for kind in ("key", "value")]


def param_shapes(cfg: ModelConfig) -> dict[str, list[int]]:
    """Every weight of the graph, in creation (and save) order."""
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    shapes: dict[str, list[int]] = {"rope.inv_freq": [d // 2], "embed_tokens.weight": [cfg.vocab_size, h]}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = [h]
        shapes[p + "self_attn.qkv_proj.weight"] = [h, qkv]
        if cfg.attention_bias:
            shapes[p + "self_attn.qkv_proj.bias"] = [qkv]
        shapes[p + "self_attn.o_proj.weight"] = [cfg.num_attention_heads * d, h]
        if cfg.attention_bias and cfg.architecture == "llama":  # HF Llama's attention_bias covers o_proj too
            shapes[p + "self_attn.o_proj.bias"] = [h]
        shapes[p + "post_attention_layernorm.weight"] = [h]
        shapes[p + "mlp.gate_up_proj.weight"] = [h, 2 * cfg.intermediate_size]
        shapes[p + "mlp.down_proj.weight"] = [cfg.intermediate_size, h]
    shapes["norm.weight"] = [h]
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = [h, cfg.vocab_size]
    return shapes


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Seeded random weights: the same seed gives the same arrays on every machine."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes(cfg).items():
        if name == "rope.inv_freq":
            out[name] = cfg.inv_freq()
        elif name.endswith("norm.weight"):
            out[name] = np.ones(shape, np.float32)
        else:
            out[name] = (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)).astype(np.float32)
    return out


class LlamaPaddle:
    def __init__(self, cfg: ModelConfig, params: dict[str, paddle.Tensor]):
        self.cfg = cfg
        self.p = params
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads
        self.q_dim = cfg.num_attention_heads * cfg.head_dim
        self.kv_dim = cfg.num_key_value_heads * cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    @classmethod
    def from_numpy(cls, cfg: ModelConfig, weights: dict[str, np.ndarray]) -> LlamaPaddle:
        """An eager (dygraph) model over the given weights."""
        missing = set(param_shapes(cfg)) - set(weights)
        if missing:
            raise ValueError(f"missing weights: {sorted(missing)}")
        return cls(cfg, {n: paddle.to_tensor(weights[n]) for n in param_shapes(cfg)})

    # ---- shared pieces -------------------------------------------------------------
    def _norm(self, x, name: str):
        var = paddle.mean(x * x, axis=-1, keepdim=True)
        return self.p[name] * (x * paddle.rsqrt(var + self.cfg.rms_norm_eps))

    def _rope(self, x, cos, sin, heads: int):
        """x [T, heads*D]; rotate-half convention (HF checkpoints' q/k layout)."""
        d = self.cfg.head_dim
        x = paddle.reshape(x, [-1, heads, d])
        x1, x2 = paddle.split(x, 2, axis=-1)
        rotated = paddle.concat([-x2, x1], axis=-1)
        return paddle.reshape(x * cos + rotated * sin, [-1, heads * d])

    def _cos_sin(self, positions):
        freqs = paddle.unsqueeze(positions.astype("float32"), 1) * paddle.unsqueeze(self.p["rope.inv_freq"], 0)
        emb = paddle.unsqueeze(paddle.concat([freqs, freqs], axis=-1), 1)  # [T, 1, D]
        return paddle.cos(emb), paddle.sin(emb)

    def _qkv(self, i: int, x, cos, sin):
        p = f"layers.{i}.self_attn."
        qkv = paddle.matmul(x, self.p[p + "qkv_proj.weight"])
        if self.cfg.attention_bias:
            qkv = qkv + self.p[p + "qkv_proj.bias"]
        q, k, v = paddle.split(qkv, [self.q_dim, self.kv_dim, self.kv_dim], axis=-1)
        kv_heads = self.cfg.num_key_value_heads
        return self._rope(q, cos, sin, self.cfg.num_attention_heads), self._rope(k, cos, sin, kv_heads), v

    # Tensor-parallel hooks (runners/paddle/export_mp.py overrides them): identities for one rank.
    def _all_reduce(self, x):
        return x

    def _embed(self, ids):
        return paddle.gather(self.p["embed_tokens.weight"], ids)

    def _o_proj(self, i: int, attn):
        out = self._all_reduce(paddle.matmul(attn, self.p[f"layers.{i}.self_attn.o_proj.weight"]))
        bias = self.p.get(f"layers.{i}.self_attn.o_proj.bias")
        return out if bias is None else out + bias

    def _mlp(self, i: int, x):
        gate, up = paddle.split(paddle.matmul(x, self.p[f"layers.{i}.mlp.gate_up_proj.weight"]), 2, axis=-1)
        down = paddle.matmul(paddle.nn.functional.silu(gate) * up, self.p[f"layers.{i}.mlp.down_proj.weight"])
        return self._all_reduce(down)

    def _logits(self, h):
        h = self._norm(h, "norm.weight")
        if self.cfg.tie_word_embeddings:
            return paddle.matmul(h, self.p["embed_tokens.weight"], transpose_y=True)
        return paddle.matmul(h, self.p["lm_head.weight"])

    def _layers(self, h, cos, sin, attend):
        for i in range(self.cfg.num_hidden_layers):
            x = self._norm(h, f"layers.{i}.input_layernorm.weight")
            q, k, v = self._qkv(i, x, cos, sin)
            h = h + self._o_proj(i, attend(i, q, k, v))
            h = h + self._mlp(i, self._norm(h, f"layers.{i}.post_attention_layernorm.weight"))
        return h

    # ---- dense reference -------------------------------------------------------------
    def forward_dense(self, input_ids) -> tuple[paddle.Tensor, list, list]:
        """Logits [T, V] of every position of one sequence, and each layer's K (after RoPE) and V [T, kv_dim]."""
        cfg = self.cfg
        ids = paddle.to_tensor(np.asarray(input_ids, dtype=np.int64))
        t = ids.shape[0]
        cos, sin = self._cos_sin(paddle.arange(t, dtype="int64"))
        causal = paddle.tril(paddle.ones([t, t], dtype="bool"))
        keys, values = [], []

        def attend(i, q, k, v):
            keys.append(k)
            values.append(v)
            heads, d = cfg.num_attention_heads, cfg.head_dim
            qh = paddle.transpose(paddle.reshape(q, [t, heads, d]), [1, 0, 2])  # [H, T, D]
            kh = paddle.repeat_interleave(paddle.reshape(k, [t, -1, d]), self.group, axis=1)  # [T, H, D]
            vh = paddle.repeat_interleave(paddle.reshape(v, [t, -1, d]), self.group, axis=1)
            s = paddle.matmul(qh, paddle.transpose(kh, [1, 2, 0])) * self.scale  # [H, T, T]
            s = paddle.where(causal, s, paddle.full_like(s, float("-inf")))
            o = paddle.matmul(paddle.nn.functional.softmax(s, axis=-1), paddle.transpose(vh, [1, 0, 2]))
            return paddle.reshape(paddle.transpose(o, [1, 0, 2]), [t, heads * d])

        h = self._layers(self._embed(ids), cos, sin, attend)
        return self._logits(h), keys, values

    # ---- paged step --------------------------------------------------------------------
    def _attention_plan(self, inp: dict, seq, tok):
        """The layer-independent part of one group's attention, computed once per step.

        tok [R, Qc]: packed token of each query of each tile (padded slots repeat a real
        token; their outputs are never read). Each row gathers its own context K/V,
        positions 0..L-1 with L the longest context among the rows, through its sequence's
        block table: memory R x L x kv_dim, not T x L x kv_dim.
        Returns (query index [R, Qc, 1], context slots [R, L, 1], additive mask [R, 1, Qc*G, L]).
        """
        qpos = paddle.gather_nd(inp["positions"], paddle.unsqueeze(tok, -1))  # [R, Qc]
        ctx = paddle.arange(0, paddle.max(qpos) + 1, dtype="int64")  # [L]: key positions
        bs = inp["block_size"]
        blocks = paddle.index_select(paddle.gather(inp["block_tables"], seq), ctx // bs, axis=1)  # [R, L]
        slots = paddle.unsqueeze(blocks * bs + ctx % bs, -1)
        # Query axis is (Qc, G) after the GQA fold below; causal mask from positions.
        visible = paddle.unsqueeze(ctx, [0, 1]) <= paddle.unsqueeze(paddle.repeat_interleave(qpos, self.group, 1), -1)
        bias = (paddle.unsqueeze(visible, 1).astype("float32") - 1.0) * 1e30  # exp() of hidden keys is 0.0
        return paddle.unsqueeze(tok, -1), slots, bias

    def _paged_attention(self, q_all, k_cache, v_cache, plan):
        """GQA attention of one group: the G query heads of a KV head are folded into the
        tile's query axis, [R, KV, Qc*G, D] against [R, KV, L, D]."""
        tok, slots, bias = plan
        kv, g, d = self.cfg.num_key_value_heads, self.group, self.cfg.head_dim
        k = paddle.transpose(paddle.reshape(paddle.gather_nd(k_cache, slots), [0, 0, kv, d]), [0, 2, 1, 3])
        v = paddle.transpose(paddle.reshape(paddle.gather_nd(v_cache, slots), [0, 0, kv, d]), [0, 2, 1, 3])
        q = paddle.reshape(paddle.gather_nd(q_all, tok), [0, 0, kv, g, d])  # [R, Qc, KV, G, D]
        q = paddle.reshape(paddle.transpose(q, [0, 2, 1, 3, 4]), [0, 0, -1, d])  # [R, KV, Qc*G, D]
        s = paddle.matmul(q, k, transpose_y=True) * self.scale + bias  # [R, KV, Qc*G, L]
        o = paddle.matmul(paddle.nn.functional.softmax(s, axis=-1), v)  # [R, KV, Qc*G, D]
        o = paddle.transpose(paddle.reshape(o, [0, 0, -1, g * d]), [0, 2, 1, 3])  # [R, Qc, KV, G*D]
        return paddle.reshape(o, [-1, self.q_dim])

    def forward_paged(self, inp: dict, caches: list) -> paddle.Tensor:
        """One step: logits [N, V] for inp["logits_index"]; writes K/V into `caches` in place.

        caches: [key_cache_0, value_cache_0, key_cache_1, ...], each [num_slots, kv_dim].
        """
        cos, sin = self._cos_sin(inp["positions"])
        slots = inp["slot_mapping"]
        tile_plan = self._attention_plan(inp, inp["tile_seq"], inp["tile_tok"])
        row_plan = self._attention_plan(inp, inp["row_seq"], inp["row_tok"])

        def attend(i, q, k, v):
            # `paddle.scatter_` degrades to out-of-place `scatter` in static mode (its
            # decorator is dygraph-only), and save_inference_model would then store a copy
            # that the predictor throws away. The raw op `_C_ops.scatter_` is recorded as
            # "pd_op.scatter_", survives saving, and updates the fed cache buffer in place
            # (bound once with share_external_data). Reading through its result orders the
            # gathers below after the write.
            k_cache = paddle._C_ops.scatter_(caches[2 * i], slots, k, True)
            v_cache = paddle._C_ops.scatter_(caches[2 * i + 1], slots, v, True)
            tiles = self._paged_attention(q, k_cache, v_cache, tile_plan)
            rows = self._paged_attention(q, k_cache, v_cache, row_plan)
            return paddle.gather(paddle.concat([tiles, rows], axis=0), inp["out_index"])

        h = self._layers(self._embed(inp["input_ids"]), cos, sin, attend)
        return self._logits(paddle.gather(h, inp["logits_index"]))


def build_paged_program(cfg: ModelConfig, model: Callable[[ModelConfig, dict], LlamaPaddle] = LlamaPaddle):
    """Trace `model(cfg, params).forward_paged` into a PIR program. Call in static mode.

    Returns (main, startup, feed values in INPUT_SPECS + cache order, logits value).
    Parameters are created zero-initialised under their `param_shapes` names; the caller
    runs `startup` and then sets real values in the scope.
    """
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        inp = {name: paddle.static.data(name, shape, dtype) for name, shape, dtype in INPUT_SPECS}
        kv_dim = cfg.num_key_value_heads * cfg.head_dim
        caches = [paddle.static.data(n, [-1, kv_dim], "float32") for n in cache_names(cfg.num_hidden_layers)]
        zero = paddle.nn.initializer.Constant(0.0)
        params = {
            name: paddle.static.create_parameter(shape, "float32", name=name, default_initializer=zero)
            for name, shape in param_shapes(cfg).items()
        }
        logits = model(cfg, params).forward_paged(inp, caches)
    return main, startup, [*inp.values(), *caches], logits
