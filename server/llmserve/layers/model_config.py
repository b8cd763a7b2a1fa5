"""Model hyper-parameters, read from a HF-style config.json.

Both runners and the exporter use this one description. Llama and Qwen2 share
the decoder; Qwen2 adds a bias to the q/k/v projections. DeepSeek-V2/V3 add
their attention (`mla`) and experts (`moe`), read by deepseek_config.py; for
them `num_key_value_heads` and `head_dim` describe the KV cache (one latent
"head" of kv_lora_rank + qk_rope_head_dim), not the query heads.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from llmserve.layers.deepseek_config import DEEPSEEK_ARCHITECTURES, MLAConfig, MoEConfig, deepseek_fields
from llmserve.layers.rope import rope_inv_freq, rope_type

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    **DEEPSEEK_ARCHITECTURES,
}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "deepseek_v3": "deepseek_v3", "deepseek_v2": "deepseek_v2"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "deepseek_v3" | "deepseek_v2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    # rope scaling as sorted (key, value) pairs (hashable); see layers/rope.py
    rope_scaling: tuple[tuple[str, object], ...] = ()
    mla: MLAConfig | None = None  # DeepSeek's latent attention
    moe: MoEConfig | None = None  # DeepSeek's experts
    num_nextn_predict_layers: int = 0  # MTP modules after the trunk (`model.layers.{N}.`)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        archs = d.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = MODEL_TYPES.get(d.get("model_type", ""))
        if arch is None:
            raise ValueError(
                f"unsupported model: architectures={archs} model_type={d.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        scaling = d.get("rope_scaling") or d.get("rope_parameters") or {}
        kind = rope_type(scaling)
        scaling = {} if kind == "default" else {k: v for k, v in scaling.items() if k != "rope_theta"}
        deepseek = arch.startswith("deepseek")
        if kind == "yarn" and not deepseek:  # its attention factor is applied by the MLA model only
            raise ValueError(f"{arch}: rope_scaling type 'yarn' is supported for DeepSeek models only")
        if kind == "yarn":  # transformers' defaults, made explicit
            scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings", 4096))
            if scaling.get("factor") is None:
                scaling["factor"] = d.get("max_position_embeddings", 4096) / scaling["original_max_position_embeddings"]
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_theta = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        if deepseek:  # its attention and experts; its cache's heads and width (deepseek_config.py)
            shape = deepseek_fields(d, arch)
        else:
            shape = dict(
                intermediate_size=d["intermediate_size"],
                num_key_value_heads=d.get("num_key_value_heads") or heads,
                head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            )
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            **shape,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            rope_scaling=tuple(sorted(scaling.items())),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_hf_dict(self) -> dict:
        """A config.json that HF transformers and this class both read (Llama / Qwen2)."""
        if self.mla is not None:
            raise ValueError(f"to_hf_dict: {self.architecture} configs are read from their checkpoint, not written")
        d = asdict(self)
        for f in ("mla", "moe", "num_nextn_predict_layers"):
            d.pop(f)
        arch = d.pop("architecture")
        eos = d.pop("eos_token_ids")
        d.pop("dtype")
        scaling = dict(d.pop("rope_scaling"))
        if scaling:
            d["rope_scaling"] = scaling
        d.update(
            architectures=["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
            model_type=arch,
            eos_token_id=list(eos) if len(eos) != 1 else eos[0],
            torch_dtype=self.dtype,
            hidden_act="silu",
        )
        if arch == "qwen2":
            d.pop("attention_bias")
        return d

    def inv_freq(self):
        """Rotary inverse frequencies (numpy float32), scaling included (MLA: of its rope dimensions)."""
        dim = self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim
        return rope_inv_freq(dim, self.rope_theta, dict(self.rope_scaling))

    @property
    def kv_latent_dim(self) -> int:
        """MLA: the cached row's leading features that are also its value (the latent; kv_cache.py), else 0."""
        return self.mla.kv_lora_rank if self.mla is not None else 0

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers (MLA: its one cached row), in the model's dtype."""
        itemsize = 2 if self.dtype in ("bfloat16", "float16") else 4
        planes = 1 if self.mla is not None else 2
        return planes * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * itemsize
