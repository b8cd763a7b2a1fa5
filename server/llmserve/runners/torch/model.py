"""Llama / Qwen2 decoder over the paged KV cache.

Weights are read from HF safetensors and fused where one matrix product can
replace several: q/k/v into one projection (with Qwen2's biases), gate/up
into one. Each layer is: fused residual+RMSNorm, qkv projection, rotary + KV
cache write, paged attention, output projection, fused residual+RMSNorm,
gate_up projection, SwiGLU, down projection. Matrix products go to cuBLAS
(torch.nn.functional.linear); the rest are our kernels (kernels/).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from llmserve.models.config import ModelConfig

from .kernels.activation import swiglu
from .kernels.attention import AttnMeta, paged_attention
from .kernels.norm import rms_norm
from .kernels.rotary import rope_and_cache, rope_cos_sin


@dataclass
class LayerWeights:
    in_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2*KVH) * D, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor


class _Reader:
    """Tensors by name across all *.safetensors files of a directory."""

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}")
        self.where: dict[str, Path] = {}
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            for name, f in json.loads(index.read_text())["weight_map"].items():
                self.where[name] = model_dir / f
        else:
            for f in files:
                with safe_open(f, framework="pt") as h:
                    for name in h.keys():
                        self.where[name] = f
        self.handles = {f: safe_open(f, framework="pt") for f in set(self.where.values())}
        self.device, self.dtype = device, dtype

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise KeyError(f"weight {name!r} not found in the checkpoint")
        return self.handles[self.where[name]].get_tensor(name).to(self.device, self.dtype)

    def cat(self, *names: str) -> torch.Tensor:
        return torch.cat([self.get(n) for n in names], dim=0)


class DecoderModel:
    def __init__(
        self, cfg: ModelConfig, model_dir: str | Path, device: torch.device, dtype: torch.dtype, max_positions: int
    ) -> None:
        self.cfg = cfg
        self.device, self.dtype = device, dtype
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.scale = self.head_dim**-0.5
        r = _Reader(Path(model_dir), device, dtype)
        self.embed = r.get("model.embed_tokens.weight")
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if r.has(a + "q_proj.bias"):
                bias = r.cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
            self.layers.append(
                LayerWeights(
                    in_norm=r.get(p + "input_layernorm.weight"),
                    qkv=r.cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                    qkv_bias=bias,
                    o=r.get(a + "o_proj.weight"),
                    post_norm=r.get(p + "post_attention_layernorm.weight"),
                    gate_up=r.cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down=r.get(p + "mlp.down_proj.weight"),
                )
            )
        self.norm = r.get("model.norm.weight")
        tied = cfg.tie_word_embeddings or not r.has("lm_head.weight")
        self.lm_head = self.embed if tied else r.get("lm_head.weight")
        self.cos_sin = rope_cos_sin(cfg.inv_freq(), max_positions, device)
        # Experimental (LLMSERVE_FP32_PROJ_OUT=1, CUDA bf16 only): o/down projections and logits
        # written in fp32 by cuBLAS; measured for parity and speed in docs/gpu_notes.md.
        self.fp32_out = (
            os.environ.get("LLMSERVE_FP32_PROJ_OUT") == "1"
            and device.type == "cuda"
            and self.embed.dtype != torch.float32
        )

    @property
    def weight_bytes(self) -> int:
        ts = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for lw in self.layers:
            ts += [t for t in vars(lw).values() if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        meta: AttnMeta,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; writes this step's K/V into `kv_cache`
        ([layers, 2, num_blocks, KVH, block_size, D])."""
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        eps = self.cfg.rms_norm_eps
        T = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)
        # The residual stream stays in fp32: in bf16 its rounding, summed over 2 * layers
        # additions, is the largest error of a bf16 forward (a few % of the logits at 32 layers).
        residual = h.float()
        x = rms_norm(h, self.layers[0].in_norm, eps) if self.layers else h
        for i, lw in enumerate(self.layers):
            if i > 0:
                x = rms_norm(h, lw.in_norm, eps, residual)
            qkv = F.linear(x, lw.qkv, lw.qkv_bias)
            rope_and_cache(qkv, positions, slot_mapping, self.cos_sin, kv_cache[i, 0], kv_cache[i, 1], H, KVH)
            q = qkv[:, : H * D].view(T, H, D)
            attn = paged_attention(q, kv_cache[i, 0], kv_cache[i, 1], meta, self.scale)
            h = self._into_residual(attn.view(T, H * D), lw.o)
            x = rms_norm(h, lw.post_norm, eps, residual)
            h = self._into_residual(swiglu(F.linear(x, lw.gate_up)), lw.down)
        return rms_norm(h, self.norm, eps, residual)

    def _into_residual(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Projections added into the fp32 residual: with fp32_out, cuBLAS writes fp32 (no bf16 rounding)."""
        if self.fp32_out:
            return torch.mm(a, w.t(), torch.float32)
        return F.linear(a, w)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fp32_out:
            return torch.mm(hidden, self.lm_head.t(), torch.float32)
        return F.linear(hidden, self.lm_head).float()
