"""Model hyper-parameters, read from a HF-style config.json.

Both runners and the exporter use this one description. Llama and Qwen2 share
the decoder; Qwen2 adds a bias to the q/k/v projections.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from llmserve.layers.rope import rope_inv_freq, rope_type

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen2"
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

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        archs = d.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = {"llama": "llama", "qwen2": "qwen2"}.get(d.get("model_type", ""))
        if arch is None:
            raise ValueError(
                f"unsupported model: architectures={archs} model_type={d.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        scaling = d.get("rope_scaling") or d.get("rope_parameters") or {}
        kind = rope_type(scaling)
        scaling = {} if kind == "default" else {k: v for k, v in scaling.items() if k != "rope_theta"}
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_theta = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
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
        """A config.json that HF transformers and this class both read."""
        d = asdict(self)
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
        """Rotary inverse frequencies (numpy float32), scaling included."""
        return rope_inv_freq(self.head_dim, self.rope_theta, dict(self.rope_scaling))

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, in the model's dtype."""
        itemsize = 2 if self.dtype in ("bfloat16", "float16") else 4
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * itemsize
