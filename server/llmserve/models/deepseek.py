"""DeepSeek-V2 / V3 decoder over the paged KV cache (HF `DeepseekV2ForCausalLM` / `DeepseekV3ForCausalLM`).

Each layer: RMSNorm, multi-head latent attention (layers/mla.py: the cache holds each token's latent and
rope key), residual, RMSNorm, then a dense SwiGLU MLP for the first `first_k_dense_replace` layers and the
mixture of experts after (layers/moe.py), residual. Then the final norm and the LM head. The same interface
as llama.py's `DecoderModel`, which the torch runner drives (forward, logits, cfg, local, weight_bytes).

The residual stream stays in float32, as llama.py's does. The checkpoint's MTP layer (`model.layers.{N}.`,
`num_nextn_predict_layers`) serves SPECULATE_METHOD=mtp (runners/torch/mtp.py): the head builds its decoder
layer here (`load_head_layer`: MLA over one more latent-cache layer, MoE as layer N would be) and runs it as
the trunk runs its own (`layer`).

Tensor parallelism (MP_NUM = N, parallel.py): each rank holds 1/N of the query heads (its rows of q and kv_b,
its columns of o) and attends with them over the whole latent cache, which every rank keeps (each head
reads all of it), and 1/N of every MLP's intermediate features, each routed
and shared expert's included (rather than 1/N of the experts: every rank then does the same work whatever
the router picks, and batch-1 decode reads 1/N of each chosen expert on each rank; expert parallelism is
issue 48's). The router runs on every rank over the same hidden states; o's and the MLP's partial sums are
added up by the all-reduce before the next norm, as in llama.py. On CUDA, decode and verification steps (and the MTP head's) replay CUDA graphs: the MLA
decode kernel, the cache write and the fused experts wait on nothing; where a torch path would
(`graph_blocker`), the runner runs the steps eagerly and says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from llmserve.config import Config
from llmserve.kernels.attention import AttnMeta
from llmserve.kernels.mla_decode import MLA_MAX_Q
from llmserve.kernels.mla_decode import fits as mla_decode_fits
from llmserve.kernels.norm import rms_norm
from llmserve.kernels.rotary import rope_cos_sin
from llmserve.layers.kv_cache import KVCache, LayerKV
from llmserve.layers.mla import MLAttention, load_mla
from llmserve.layers.model_config import ModelConfig
from llmserve.layers.moe import MLP, MoE
from llmserve.layers.parallel import SINGLE, Shard, TensorParallel, embed, gather_logits, vocab_rows
from llmserve.layers.quant.methods import LinearMethod
from llmserve.layers.rope import yarn_attention_factor, yarn_softmax_mscale
from llmserve.layers.weights import WeightReader


@dataclass
class DeepseekLayer:
    in_norm: torch.Tensor
    attn: MLAttention
    post_norm: torch.Tensor
    mlp: MLP | MoE


class DeepseekModel:
    @staticmethod
    def check_settings(cfg: ModelConfig, config: Config, device: torch.device) -> None:
        """ConfigError naming each setting this family cannot serve (before any weight is read): none today
        (MP_NUM's shapes are parallel.py's `check_shardable`; MTP with MP_NUM > 1 is config.py's)."""

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
        if cfg.mla is None or cfg.moe is None:
            raise ValueError(f"DeepseekModel: {cfg.architecture} has no MLA / MoE config")
        self.cfg, self.tp, self.shard = cfg, tp, Shard(cfg, tp)
        self.local = self.shard.local_config  # this rank's heads and dense MLP features (parallel.py)
        self.device, self.dtype = device, dtype
        self.method = method or LinearMethod(dtype)
        r = WeightReader(Path(model_dir), device, dtype)
        scaling = dict(cfg.rope_scaling)
        # YaRN: cos/sin carry its attention factor (on q's and k's rope parts alike), the scale its mscale
        self.cos_sin = rope_cos_sin(cfg.inv_freq(), max_positions, device) * yarn_attention_factor(scaling)
        self.scale = cfg.mla.qk_head_dim**-0.5 * yarn_softmax_mscale(scaling)
        self.out_dtype = torch.float32  # what the products write: the residual stream's dtype
        self.embed = vocab_rows(r, "model.embed_tokens.weight", self.shard)
        # the MTP layers after them are read by the MTP head (load_head_layer)
        self.layers = [
            self._load_layer(r, f"model.layers.{i}.", cfg.moe.is_moe(i)) for i in range(cfg.num_hidden_layers)
        ]
        self.norm = r.get("model.norm.weight")
        tied = cfg.tie_word_embeddings or not r.has("lm_head.weight")
        self.lm_head = self.embed if tied else vocab_rows(r, "lm_head.weight", self.shard)

    def _load_layer(self, r: WeightReader, p: str, moe: bool) -> DeepseekLayer:
        """The decoder layer under `p` (e.g. "model.layers.3."): MLA, then the experts or a dense MLP."""
        cfg, H, m, tp = self.cfg, self.cfg.num_attention_heads, p + "mlp.", self.tp
        split = tp.size > 1  # heads, and every MLP's intermediate features (parallel.py)
        if moe:
            mlp = MoE.load(r, m, self.method, cfg.moe, self.shard if split else None)
        else:
            mlp = MLP.load(r, m, self.method, self.shard.mlp_rows() if split else None)
        w = load_mla(r, p + "self_attn.", self.method, cfg.mla, H, self.shard.heads() if split else None)
        attn = MLAttention(w, cfg.mla, self.local.num_attention_heads, self.scale, self.cos_sin)
        norms = r.get(p + "input_layernorm.weight"), r.get(p + "post_attention_layernorm.weight")
        return DeepseekLayer(norms[0], attn, norms[1], mlp)

    def load_head_layer(self, r: WeightReader, p: str) -> DeepseekLayer:
        """A head proposer's decoder layer under `p` (runners/torch/mtp.py: the MTP layer, index N =
        num_hidden_layers): layer N of this model, the experts where `moe.is_moe(N)` (V3's layout: always)."""
        return self._load_layer(r, p, self.cfg.moe.is_moe(self.cfg.num_hidden_layers))

    def graph_blocker(self, kv_cache: KVCache, max_q: int) -> str | None:
        """Why steps of up to `max_q` queries a sequence cannot be captured as CUDA graphs (None: they can):
        the torch paths of the experts (a format fused_moe does not read) and of MLA wait on the host."""
        moe = [lw.mlp for lw in self.layers if isinstance(lw.mlp, MoE)]
        if any(m.stacked is None for m in moe):
            return f"the routed experts in {self.method.name} run expert by expert (layers/moe.py `_routed_loop`)"
        if not mla_decode_fits(self.cfg.mla.kv_lora_rank, self.cfg.mla.qk_rope_head_dim, kv_cache.data):
            return f"the latent cache ({kv_cache.data.dtype}) is not the MLA decode kernel's"
        if max_q > MLA_MAX_Q:
            return f"verification steps of {max_q} queries: the MLA decode kernel takes {MLA_MAX_Q} a sequence"
        return None

    @property
    def weight_bytes(self) -> int:
        ts = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        n = sum(t.numel() * t.element_size() for t in ts)
        for lw in self.layers:
            w = lw.attn.w
            n += w.q_a_kv_a.nbytes + w.q.nbytes + w.o.nbytes + lw.mlp.nbytes
            norms = [w.kv_a_norm, lw.in_norm, lw.post_norm] + ([w.q_a_norm] if w.q_a_norm is not None else [])
            n += sum(t.numel() * t.element_size() for t in [w.w_uk, w.w_uv, *norms])
        return n

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        meta: AttnMeta,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; writes this step's latent rows into `kv_cache`."""
        eps = self.cfg.rms_norm_eps
        h = embed(input_ids.long(), self.embed, self.shard)
        residual = h.float()
        x = rms_norm(h, self.layers[0].in_norm, eps) if self.layers else h
        out = None
        for i, lw in enumerate(self.layers):
            if i > 0:  # residual += the last MLP's output (the ranks' partial sums added up)
                x = self.tp.sum_norm(out, lw.in_norm, eps, residual)
            out = self.layer(lw, x, residual, positions, slot_mapping, meta, kv_cache.layer(i))
        return self.tp.sum_norm(out, self.norm, eps, residual) if out is not None else rms_norm(h, self.norm, eps)

    def layer(
        self,
        lw: DeepseekLayer,
        x: torch.Tensor,
        residual: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        meta: AttnMeta,
        kv: LayerKV,
    ) -> torch.Tensor:
        """One decoder layer on its normed input `x` (llama.py's `layer` contract, which the MTP head calls):
        attention (its latent rows into `kv`), `residual += its output`, then the MLP's output, which the
        caller adds to the residual with the next norm."""
        a = lw.attn(x, positions, slot_mapping, meta, kv, torch.float32)
        return lw.mlp(self.tp.sum_norm(a, lw.post_norm, self.cfg.rms_norm_eps, residual), torch.float32)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32."""
        return gather_logits(self.method.dense.apply({"weight": self.lm_head}, hidden, None, torch.float32), self.shard)
