"""Llama / Qwen2 decoder over the paged KV cache.

Weights are read from HF safetensors and fused where one matrix product can
replace several: q/k/v into one projection (with Qwen2's biases), gate/up
into one. Each layer is: fused residual+RMSNorm, qkv projection, rotary + KV
cache write, paged attention, output projection, fused residual+RMSNorm,
gate_up projection, SwiGLU, down projection. The projections are `Linear` layers
whose quantization method (quant/methods.py: dense, weight-only int8/int4, GPTQ, AWQ,
FP8) the checkpoint or QUANT_TYPE chose; dense ones go to cuBLAS, quantized ones to
our GEMMs; the rest are our kernels (kernels/). Embedding and LM head stay dense. At batch 1 on
one GPU the norms ride in the products' GEMVs instead (`Normed`; the `gemv_norm` switch, kernels/switches.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from llmserve.kernels import switches
from llmserve.kernels.activation import swiglu
from llmserve.kernels.attention import AttnMeta, paged_attention
from llmserve.kernels.gemv import NormedRow, RopeCache, gemv
from llmserve.kernels.norm import rms_norm
from llmserve.kernels.rotary import rope_and_cache, rope_cos_sin
from llmserve.kernels.skinny import skinny
from llmserve.layers.kv_cache import KVCache, LayerKV
from llmserve.layers.linear import Linear
from llmserve.layers.model_config import ModelConfig
from llmserve.layers.parallel import SINGLE, Shard, TensorParallel, embed, gather_logits, vocab_rows
from llmserve.layers.quant.methods import LinearMethod, load_linear
from llmserve.layers.weights import WeightReader


def one_gemv(linear: Linear, x: torch.Tensor, out_dtype: torch.dtype) -> tuple | None:
    """`linear`'s GEMV operands (weight, scale) where its product of x (or of a tensor of x's dtype and rows) is one
    GEMV without scale blocks (kernels/gemv.py), else None; nothing is computed."""
    ops = linear.gemv_operands(x, out_dtype)
    return None if ops is None or ops[2] else ops[:2]


@dataclass(frozen=True)
class Normed:
    """RMSNorm(residual) * weight, where the residual is one row (batch-1 decode, one rank). `row`: the norm left
    pending by the GEMV that added the last product into the residual (kernels/gemv.py `NormedRow`), which the next
    one-row GEMV takes instead of the norm's kernel; else (the first layer's input, or a product that is not a
    GEMV) `value()` runs the kernel. `like`: a tensor of the norm output's dtype and rows, to ask a layer whether its
    product is a GEMV."""

    residual: torch.Tensor  # fp32 [1, hidden]
    weight: torch.Tensor
    eps: float
    like: torch.Tensor
    row: NormedRow | None = None

    def value(self) -> torch.Tensor:
        return rms_norm(self.residual, self.weight, self.eps)

    def gemv_args(self, linear: Linear, out_dtype: torch.dtype) -> dict | None:
        """gemv()'s x, weight, scale (and norm) where `one_gemv` has them: the norm computed here if no GEMV left
        it pending."""
        if (ops := one_gemv(linear, self.like, out_dtype)) is None:
            return None
        if self.row is None:
            return dict(x=self.value(), weight=ops[0], scale=ops[1])
        return dict(x=self.row.u, weight=ops[0], scale=ops[1], norm=self.row)


def as_tensor(x: torch.Tensor | Normed) -> torch.Tensor:
    return x.value() if isinstance(x, Normed) else x


@dataclass
class LayerWeights:
    in_norm: torch.Tensor
    qkv: Linear  # hidden -> (H + 2*KVH) * D, with Qwen2's biases
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear


def load_layer(r: WeightReader, p: str, method: LinearMethod, shard: Shard | None = None) -> LayerWeights:
    """One decoder layer's weights under prefix `p` (e.g. "model.layers.3."), q/k/v and gate/up fused;
    with a shard of several ranks, this rank's rows of q/k/v and gate/up and columns of o and down
    (parallel.py)."""
    a, m = p + "self_attn.", p + "mlp."
    q = kv = mlp = o = down = None
    if shard is not None and shard.tp.size > 1:
        q, kv, mlp = (0, *shard.q_rows()), (0, *shard.kv_rows()), (0, *shard.mlp_rows())
        o, down = (1, *shard.q_rows()), (1, *shard.mlp_rows())
    row_parallel_bias = shard is None or shard.tp.rank == 0  # added once, not once per rank
    return LayerWeights(
        in_norm=r.get(p + "input_layernorm.weight"),
        qkv=load_linear(method, r, (a + "q_proj.", q), (a + "k_proj.", kv), (a + "v_proj.", kv)),
        o=load_linear(method, r, (a + "o_proj.", o), bias=row_parallel_bias),
        post_norm=r.get(p + "post_attention_layernorm.weight"),
        gate_up=load_linear(method, r, (m + "gate_proj.", mlp), (m + "up_proj.", mlp)),
        down=load_linear(method, r, (m + "down_proj.", down), bias=row_parallel_bias),
    )


class DecoderModel:
    def __init__(
        self,
        cfg: ModelConfig,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int,
        method: LinearMethod | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        self.cfg = cfg  # the whole model's; `local` is this rank's share (parallel.py)
        self.shard = Shard(cfg, tp)
        self.tp = tp
        self.local = local = self.shard.local_config
        self.device, self.dtype = device, dtype
        self.num_heads, self.num_kv_heads, self.head_dim = (
            local.num_attention_heads,
            local.num_key_value_heads,
            local.head_dim,
        )
        self.scale = self.head_dim**-0.5
        self.method = method or LinearMethod(dtype)
        r = WeightReader(Path(model_dir), device, dtype)
        shard = self.shard if tp.size > 1 else None
        self.embed = vocab_rows(r, "model.embed_tokens.weight", self.shard)
        self.layers = [load_layer(r, f"model.layers.{i}.", self.method, shard) for i in range(cfg.num_hidden_layers)]
        self.norm = r.get("model.norm.weight")
        tied = cfg.tie_word_embeddings or not r.has("lm_head.weight")
        self.lm_head = self.embed if tied else vocab_rows(r, "lm_head.weight", self.shard)
        self.cos_sin = rope_cos_sin(cfg.inv_freq(), max_positions, device)
        # bf16 on CUDA: cuBLAS writes every projection in fp32 (torch.mm's out_dtype), so an
        # activation is rounded to bf16 only where a matrix product or the KV cache needs it. Each
        # rounding we skip shrinks the logit error (docs/gpu.md: 1.21e-2 -> <1e-2 of the exact
        # function on the 8B shape) at no measured speed cost: the extra bytes are activations.
        self.wide = device.type == "cuda" and dtype != torch.float32
        self.out_dtype = torch.float32 if self.wide else dtype
        self._gemv_layers: bool | None = None  # norms_in_gemvs

    def load_head_layer(self, r: WeightReader, p: str) -> LayerWeights:
        """A head proposer's decoder layer under `p` (runners/torch/mtp.py: the MTP module's), quantized as the
        trunk is; run by `layer` (one rank: MTP refuses MP_NUM > 1)."""
        return load_layer(r, p, self.method)

    @property
    def weight_bytes(self) -> int:
        ts = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        n = sum(t.numel() * t.element_size() for t in ts)
        for lw in self.layers:
            n += sum(v.nbytes if isinstance(v, Linear) else v.numel() * v.element_size() for v in vars(lw).values())
        return n

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        meta: AttnMeta,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; writes this step's K/V into `kv_cache`
        (kv_cache.py: fp16 for a bf16 model, or int8 / FP8 with per-token scales)."""
        eps = self.cfg.rms_norm_eps
        h = embed(input_ids, self.embed, self.shard)
        # The residual stream stays in fp32: in bf16 its rounding, summed over 2 * layers
        # additions, is the largest error of a bf16 forward (a few % of the logits at 32 layers).
        residual = h.float()
        if self.norms_in_gemvs(h):  # each layer adds its rows into the residual and leaves the next norm pending
            x = Normed(residual, self.layers[0].in_norm, eps, h)
            for i, lw in enumerate(self.layers):
                then = self.layers[i + 1].in_norm if i + 1 < len(self.layers) else None
                x = self.layer(lw, x, residual, positions, slot_mapping, meta, kv_cache.layer(i), then)
            return rms_norm(residual, self.norm, eps)
        x = rms_norm(h, self.layers[0].in_norm, eps) if self.layers else h
        for i, lw in enumerate(self.layers):
            if i > 0:
                x = self.tp.sum_norm(h, lw.in_norm, eps, residual)
            h = self.layer(lw, x, residual, positions, slot_mapping, meta, kv_cache.layer(i))
        return self.tp.sum_norm(h, self.norm, eps, residual)

    def norms_in_gemvs(self, h: torch.Tensor) -> bool:
        """Whether this step's norms ride in its products (`Normed`): one row (batch-1 decode), one rank, on CUDA
        with the fp32 residual, and layers whose four products are GEMVs (else the norms stay kernels)."""
        if not (switches.current.gemv_norm and self.wide and self.tp.size == 1 and h.shape[0] == 1 and self.layers):
            return False
        if self._gemv_layers is None:  # the same answer for every one-row step: asked once
            dt = self.out_dtype
            self._gemv_layers = all(
                one_gemv(lw.qkv, h, dt) is not None
                and all(p.gemv_operands(h, dt) is not None for p in (lw.o, lw.gate_up, lw.down))
                for lw in self.layers
            )
        return self._gemv_layers

    def layer(
        self,
        lw: LayerWeights,
        x: torch.Tensor | Normed,
        residual: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        meta: AttnMeta,
        kv: LayerKV,
        then: torch.Tensor | None = None,
    ) -> torch.Tensor | Normed | None:
        """One decoder layer on its normed input `x` [T, hidden]: attention (writing K/V into `kv`,
        KVCache.layer), `residual += attention output`, then the MLP, whose output it returns: this
        rank's part of it, which the caller sums over the ranks and adds to the residual with the next
        norm (`self.tp.sum_norm`). With `x` a `Normed` (one rank, `norms_in_gemvs`), o and down add their rows
        into the residual themselves, the post-attention norm rides in gate_up's product, and this returns the
        next layer's input, `then` (its norm's weight) of the residual, pending (None without `then`)."""
        H, D = self.num_heads, self.head_dim
        T = x.residual.shape[0] if isinstance(x, Normed) else x.shape[0]
        # q stays fp32 through rotary into attention; k and v are rounded once, into the (fp16) cache.
        qkv = self.qkv_rope(lw.qkv, x, positions, slot_mapping, kv)
        k, v, k_scale, v_scale = kv
        q = qkv[:, : H * D].view(T, H, D)
        attn = paged_attention(q, k, v, meta, self.scale, self.dtype, k_scale, v_scale)
        if isinstance(x, Normed):
            post = self.add_product(lw.o, attn.view(T, H * D), x, lw.post_norm)
            return self.add_product(lw.down, self.gate_up_swiglu(lw.gate_up, post), x, then)
        # o and down are row-parallel: the ranks' parts are summed with the norm after each
        h = self.tp.row_parallel(lw.o, attn.view(T, H * D), self.out_dtype)
        x = self.tp.sum_norm(h, lw.post_norm, self.cfg.rms_norm_eps, residual)
        return self.tp.row_parallel(lw.down, self.gate_up_swiglu(lw.gate_up, x), self.out_dtype)

    def add_product(self, linear: Linear, x: torch.Tensor, at: Normed, then: torch.Tensor | None) -> Normed | None:
        """`at.residual += linear(x)` (one rank), in the GEMV's epilogue, which also leaves the RMSNorm of weight
        `then` of the sum pending; that norm as a `Normed` (None without `then`)."""
        residual, eps = at.residual, self.cfg.rms_norm_eps
        row = None
        if (ops := linear.gemv_operands(x, self.out_dtype)) is None:
            residual += linear(x, self.out_dtype)
        elif then is None:
            gemv(x, *ops, None, self.out_dtype, into=residual)
        else:
            row = gemv(x, *ops, None, self.out_dtype, into=residual, then_norm=(then, eps))
        return Normed(residual, then, eps, at.like, row) if then is not None else None

    def gemv_args(self, linear: Linear, x: torch.Tensor | Normed) -> dict | None:
        """gemv()'s x, weight, scale (and a pending norm) where `linear`'s product of `x` is one GEMV without scale
        blocks (kernels/gemv.py), else None."""
        if isinstance(x, Normed):
            return x.gemv_args(linear, self.out_dtype)
        ops = one_gemv(linear, x, self.out_dtype)
        return None if ops is None else dict(x=x, weight=ops[0], scale=ops[1])

    def qkv_rope(
        self, qkv: Linear, x: torch.Tensor | Normed, positions: torch.Tensor, slot_mapping: torch.Tensor, kv: LayerKV
    ) -> torch.Tensor:
        """The qkv projection of the normed `x` with q rotated, and k rotated and v written into the layer's
        cache: over an unquantized cache in the qkv product itself at 1-16 rows of unquantized weights (kernels/gemv.py
        at one row, skinny.py at 2-16, `rope`: the same bits, one kernel fewer a layer), else the product, then
        kernels/rotary.py."""
        k, v, k_scale, v_scale = kv
        rc = None
        if self.wide and switches.current.gemv_fuse and k_scale is None:
            rc = RopeCache(positions, slot_mapping, self.cos_sin, k, v, self.num_heads, self.num_kv_heads)
        if (args := self.gemv_args(qkv, x)) is not None:
            out = gemv(**args, out_dtype=self.out_dtype, rope=rc)
            if rc is not None:
                return out
        else:
            x = as_tensor(x)
            if rc is not None and (w := qkv.skinny_operands(x, self.out_dtype)) is not None:
                return skinny(x, w, None, self.out_dtype, rope=rc)
            out = qkv(x, self.out_dtype)
        rope_and_cache(out, positions, slot_mapping, self.cos_sin, k, v, self.num_heads, self.num_kv_heads, k_scale, v_scale)  # fmt: skip
        return out

    def gate_up_swiglu(self, gate_up: Linear, x: torch.Tensor | Normed) -> torch.Tensor:
        """silu(gate) * up of the normed `x`, in the model's dtype: in the gate_up product itself at batch 1 and at
        2-16 rows of unquantized weights (kernels/gemv.py, skinny.py, `glu`: the same bits, one kernel fewer a
        layer; not with FP8's 128-row blocks, where a program's gate and up rows span two), else the product, then
        SwiGLU."""
        fuse = self.wide and switches.current.gemv_fuse
        if (args := self.gemv_args(gate_up, x)) is not None:
            if fuse:
                return gemv(**args, out_dtype=self.dtype, glu=True)
            return swiglu(gemv(**args, out_dtype=self.out_dtype), self.dtype)
        x = as_tensor(x)
        if fuse and (w := gate_up.skinny_operands(x, self.out_dtype)) is not None:
            return skinny(x, w, None, self.dtype, glu=True)
        return swiglu(gate_up(x, self.out_dtype), self.dtype)

    def graph_blocker(self, kv_cache: KVCache, max_q: int) -> str | None:
        """Why steps could not be captured as CUDA graphs: never here (no path waits on the host)."""
        return None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """With `wide`, written in fp32 instead of rounded to bf16. With several ranks, each
        scores its rows of the vocabulary and an all-gather joins them."""
        # An unquantized product like any layer's (one row on the GEMV, 2-16 on the skinny kernel, else cuBLAS)
        return gather_logits(self.method.dense.apply({"weight": self.lm_head}, hidden, None, torch.float32), self.shard)
