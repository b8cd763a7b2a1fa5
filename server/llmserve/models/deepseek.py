"""DeepSeek-V2 / V3 decoder over the paged KV cache (HF `DeepseekV2ForCausalLM` / `DeepseekV3ForCausalLM`).

Each layer: RMSNorm, multi-head latent attention (layers/mla.py: the cache holds each token's latent and
rope key), residual, RMSNorm, then a dense SwiGLU MLP for the first `first_k_dense_replace` layers and the
mixture of experts after (layers/moe.py), residual. Then the final norm and the LM head. The same interface
as llama.py's `DecoderModel`, which the torch runner drives (forward, logits, cfg, local, weight_bytes).

The residual stream stays in float32, as llama.py's does. The MTP module's weights (`model.layers.{N}.`,
`num_nextn_predict_layers`) are left unread; SPECULATE_METHOD=mtp, tensor parallelism (MP_NUM > 1) and CUDA
graphs (the torch MLA / MoE paths sync with the host) are refused by name at start (`check_settings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from llmserve.config import Config, ConfigError
from llmserve.kernels.attention import AttnMeta
from llmserve.kernels.norm import rms_norm
from llmserve.kernels.rotary import rope_cos_sin
from llmserve.layers.kv_cache import KVCache
from llmserve.layers.mla import MLAttention, load_mla
from llmserve.layers.model_config import ModelConfig
from llmserve.layers.moe import MLP, MoE
from llmserve.layers.parallel import SINGLE, TensorParallel
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
        """ConfigError naming each setting this family cannot serve yet (before any weight is read)."""
        bad = []
        if config.mp_num > 1:
            bad.append(f"MP_NUM={config.mp_num}: one rank only")
        if config.speculate_method == "mtp":
            bad.append("SPECULATE_METHOD=mtp: its MTP layer is not served yet (ngram works)")
        if device.type == "cuda" and config.cuda_graphs:
            bad.append("LLMSERVE_CUDA_GRAPHS=1: the torch MLA / MoE paths cannot be captured yet; set it to 0")
        if bad:
            raise ConfigError(f"{cfg.architecture}: " + "; ".join(bad))

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
        if tp.size > 1:
            raise ConfigError(f"MP_NUM={tp.size}: {cfg.architecture} runs on one rank for now")
        self.cfg = self.local = cfg  # one rank: its share is the whole model
        self.tp = tp
        self.device, self.dtype = device, dtype
        self.method = method or LinearMethod(dtype)
        r = WeightReader(Path(model_dir), device, dtype)
        scaling = dict(cfg.rope_scaling)
        # YaRN: cos/sin carry its attention factor (on q's and k's rope parts alike), the scale its mscale
        cos_sin = rope_cos_sin(cfg.inv_freq(), max_positions, device) * yarn_attention_factor(scaling)
        scale = cfg.mla.qk_head_dim**-0.5 * yarn_softmax_mscale(scaling)
        H = cfg.num_attention_heads
        self.embed = r.get("model.embed_tokens.weight")
        self.layers = []
        for i in range(cfg.num_hidden_layers):  # the MTP layers after them are not read
            p = f"model.layers.{i}."
            m = p + "mlp."
            mlp = MoE.load(r, m, self.method, cfg.moe) if cfg.moe.is_moe(i) else MLP.load(r, m, self.method)
            attn = MLAttention(load_mla(r, p + "self_attn.", self.method, cfg.mla, H), cfg.mla, H, scale, cos_sin)
            norms = r.get(p + "input_layernorm.weight"), r.get(p + "post_attention_layernorm.weight")
            self.layers.append(DeepseekLayer(norms[0], attn, norms[1], mlp))
        self.norm = r.get("model.norm.weight")
        tied = cfg.tie_word_embeddings or not r.has("lm_head.weight")
        self.lm_head = self.embed if tied else r.get("lm_head.weight")

    @property
    def weight_bytes(self) -> int:
        ts = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        n = sum(t.numel() * t.element_size() for t in ts)
        for lw in self.layers:
            w = lw.attn.w
            n += w.q_a_kv_a.nbytes + w.q.nbytes + w.o.nbytes + lw.mlp.nbytes
            n += sum(t.numel() * t.element_size() for t in (w.w_uk, w.w_uv, w.kv_a_norm, lw.in_norm, lw.post_norm))
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
        h = torch.nn.functional.embedding(input_ids.long(), self.embed)
        residual = h.float()
        x = rms_norm(h, self.layers[0].in_norm, eps) if self.layers else h
        out = None
        for i, lw in enumerate(self.layers):
            if i > 0:
                x = rms_norm(out, lw.in_norm, eps, residual)  # residual += the last MLP's output
            a = lw.attn(x, positions, slot_mapping, meta, kv_cache.layer(i), torch.float32)
            x = rms_norm(a, lw.post_norm, eps, residual)
            out = lw.mlp(x, torch.float32)
        return rms_norm(out, self.norm, eps, residual) if out is not None else rms_norm(h, self.norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32."""
        return self.method.dense.apply({"weight": self.lm_head}, hidden, None, torch.float32)
