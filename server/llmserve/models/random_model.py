"""Random-weight HF checkpoints of a given shape, for GPU tests and the benchmark.

Weights are drawn with torch on the device (normal; projections with std
1 / sqrt(fan-in), the embedding 0.02; norms 1) and
saved as sharded safetensors with an index, as HF writes them; HF
transformers and TorchRunner both load the result. `write_random_deepseek`:
a DeepSeek-V3 / V2 checkpoint (MLA, experts, its MTP layer's tensors), its
config.json as transformers 5.x writes it, its tensors as HF names them.
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


# Tiny DeepSeek shapes with every feature the family has (layers/deepseek_config.py), for CPU tests.
DEEPSEEK_SHAPES = {
    "v3": dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        moe_layer_freq=1,
        num_nextn_predict_layers=1,
        rope_interleave=True,
        max_position_embeddings=512,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=128,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
    "v2": dict(
        architectures=["DeepseekV2ForCausalLM"],
        model_type="deepseek_v2",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=2,
        n_group=None,
        topk_group=None,
        topk_method="greedy",
        scoring_func="softmax",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        first_k_dense_replace=0,
        mlp_bias=False,
        max_position_embeddings=512,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
}


def write_random_deepseek(
    path: str | Path, version: str = "v3", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides
) -> Path:
    """A random DeepSeek checkpoint of DEEPSEEK_SHAPES[version] (fields replaced by `overrides`) in `path`:
    config.json, one safetensors file per layer and an index. Norm weights and the score-correction bias are
    random too, so that a wrong norm or an ignored bias changes the output."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = {**DEEPSEEK_SHAPES[version], **overrides}
    cfg = dict(
        c, hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False, attention_dropout=0.0, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.02, use_cache=True,
        head_dim=c["qk_rope_head_dim"], qk_head_dim=c["qk_nope_head_dim"] + c["qk_rope_head_dim"],
        dtype=str(dtype).removeprefix("torch."),
    )  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float | None = None) -> torch.Tensor:
        std = std if std is not None else shape[-1] ** -0.5
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return (1 + 0.2 * torch.randn(n, generator=g)).to(dtype)

    H, heads, V = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    qk, lat, rope = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["kv_lora_rank"], c["qk_rope_head_dim"]

    def mlp(p: str, inter: int) -> dict[str, torch.Tensor]:
        return {
            p + "gate_proj.weight": rnd(inter, H),
            p + "up_proj.weight": rnd(inter, H),
            p + "down_proj.weight": rnd(H, inter),
        }

    def layer(i: int) -> dict[str, torch.Tensor]:
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        t = {p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H)}
        if c["q_lora_rank"] is None:
            t[a + "q_proj.weight"] = rnd(heads * qk, H)
        else:
            q = c["q_lora_rank"]
            t[a + "q_a_proj.weight"] = rnd(q, H)
            t[a + "q_a_layernorm.weight"] = norm(q)
            t[a + "q_b_proj.weight"] = rnd(heads * qk, q)
        t[a + "kv_a_proj_with_mqa.weight"] = rnd(lat + rope, H)
        t[a + "kv_a_layernorm.weight"] = norm(lat)
        t[a + "kv_b_proj.weight"] = rnd(heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), lat)
        t[a + "o_proj.weight"] = rnd(H, heads * c["v_head_dim"])
        m = p + "mlp."
        if i < c["first_k_dense_replace"]:
            return {**t, **mlp(m, c["intermediate_size"])}
        t[m + "gate.weight"] = rnd(c["n_routed_experts"], H).float()  # float32, as transformers keeps it
        if c.get("topk_method") == "noaux_tc":
            t[m + "gate.e_score_correction_bias"] = 0.1 * torch.randn(c["n_routed_experts"], generator=g)
        for e in range(c["n_routed_experts"]):
            t.update(mlp(f"{m}experts.{e}.", c["moe_intermediate_size"]))
        if c["n_shared_experts"]:
            t.update(mlp(m + "shared_experts.", c["moe_intermediate_size"] * c["n_shared_experts"]))
        return t

    weight_map: dict[str, str] = {}

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    shard("embed.safetensors", {"model.embed_tokens.weight": rnd(V, H, std=1.0)})
    n = c["num_hidden_layers"]
    for i in range(n):
        shard(f"layer-{i:03d}.safetensors", layer(i))
    for j in range(c.get("num_nextn_predict_layers") or 0):  # the MTP module: read by transformers' MTP, not served
        p = f"model.layers.{n + j}."
        mtp = {p + "enorm.weight": norm(H), p + "hnorm.weight": norm(H), p + "eh_proj.weight": rnd(H, 2 * H)}
        shard(f"mtp-{j}.safetensors", {**layer(n + j), **mtp, p + "shared_head.norm.weight": norm(H)})
    shard("head.safetensors", {"model.norm.weight": norm(H), "lm_head.weight": rnd(V, H)})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path
