"""Random-weight HF checkpoints of a given shape, for GPU tests and the benchmark.

Weights are drawn with torch on the device (normal; projections with std
1 / sqrt(fan-in), the embedding 0.02; norms 1) and
saved as sharded safetensors with an index, as HF writes them; HF
transformers and TorchRunner both load the result.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPES = {
    # Llama-3-8B: 8.03 B parameters, 16.06 GB in bf16
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
    ),
    # Llama-3-70B: 70.55 B parameters, 141.1 GB in bf16
    "llama3-70b": dict(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        rope_theta=500000.0,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        rope_theta=10000.0,
    ),
}


def write_random_checkpoint(
    path: str | Path,
    shape: str = "llama3-8b",
    seed: int = 0,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    max_positions: int = 8192,
) -> Path:
    path = Path(path)
    if (path / "model.safetensors.index.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    s = SHAPES[shape]
    hd = s["hidden_size"] // s["num_attention_heads"]
    cfg = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        rms_norm_eps=1e-5,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        head_dim=hd,
        torch_dtype=str(dtype).removeprefix("torch."),
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        initializer_range=0.02,
        **s,
    )
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape_, std: float | None = None):
        # Fan-in init keeps every layer's output at unit scale. With std 0.02 everywhere, a
        # 32-layer random net amplifies rounding so much that HF's own bf16 forward is ~1e-1 off
        # its fp32 one; with fan-in it is ~2e-2 (scripts/lab/gpu_rounding_probe.py, H200).
        std = std if std is not None else shape_[-1] ** -0.5
        return (torch.randn(*shape_, generator=g, device=device, dtype=torch.float32) * std).to(dtype).cpu()

    H, inter, V = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    kv = s["num_key_value_heads"] * hd
    weight_map: dict[str, str] = {}

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    shard("embed.safetensors", {"model.embed_tokens.weight": rnd(V, H, std=0.02)})
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shard(
            f"layer-{i:03d}.safetensors",
            {
                p + "self_attn.q_proj.weight": rnd(H, H),
                p + "self_attn.k_proj.weight": rnd(kv, H),
                p + "self_attn.v_proj.weight": rnd(kv, H),
                p + "self_attn.o_proj.weight": rnd(H, H),
                p + "mlp.gate_proj.weight": rnd(inter, H),
                p + "mlp.up_proj.weight": rnd(inter, H),
                p + "mlp.down_proj.weight": rnd(H, inter),
                p + "input_layernorm.weight": torch.ones(H, dtype=dtype),
                p + "post_attention_layernorm.weight": torch.ones(H, dtype=dtype),
            },
        )
    shard("head.safetensors", {"model.norm.weight": torch.ones(H, dtype=dtype), "lm_head.weight": rnd(V, H)})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path
