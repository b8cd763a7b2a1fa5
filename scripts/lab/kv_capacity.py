"""KV capacity: how many tokens' KV cache fit on one GPU with MLA (DeepSeek-V2-Lite's shape) against a GQA
Llama-shaped model of the same parameter count, and DeepSeek-V3's shape for scale (issue 47 point 8).

No weights: each model's bytes per cached token come from the project's own sizing (ModelConfig.from_dict ->
kv_bytes_per_token, what KVCacheSpec allocates per token and layer), its parameter count from the config's
shapes. Tokens that fit = (GPU memory x --fraction - the bf16 weights) / bytes per token. The memory is the
GPU's own (torch.cuda.mem_get_info) when there is one, else --gpu-gb.

    PYTHONPATH=server python scripts/lab/kv_capacity.py [--gpu-gb 80] [--fraction 0.9] [--out kv_capacity.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from llmserve.layers.model_config import ModelConfig

V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
    intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
    num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1,
    topk_method="greedy", scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0,
    first_k_dense_replace=1, moe_layer_freq=1, max_position_embeddings=163840, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
)  # fmt: skip
V3 = dict(
    V2_LITE, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, q_lora_rank=1536, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
    n_group=8, topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
    routed_scaling_factor=2.5, first_k_dense_replace=3,
)  # fmt: skip
# Llama-shaped GQA (8 KV heads of 128, Llama-3's ratios), its layer count chosen for V2-Lite's 15.7 B parameters
GQA_16B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=102400, hidden_size=5120,
    intermediate_size=13824, num_hidden_layers=53, num_attention_heads=40, num_key_value_heads=8,
    max_position_embeddings=163840, tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5,
)  # fmt: skip


def params(d: dict) -> int:
    """Parameters of a config (norms and biases left out: < 0.01%)."""
    h, n, v = d["hidden_size"], d["num_hidden_layers"], d["vocab_size"]
    total = v * h * (1 if d.get("tie_word_embeddings") else 2)
    if "kv_lora_rank" not in d:  # Llama
        hd = h // d["num_attention_heads"]
        attn = 2 * h * h + 2 * h * d["num_key_value_heads"] * hd
        return total + n * (attn + 3 * h * d["intermediate_size"])
    heads, lat, rope = d["num_attention_heads"], d["kv_lora_rank"], d["qk_rope_head_dim"]
    qk = d["qk_nope_head_dim"] + rope
    q = h * heads * qk if d["q_lora_rank"] is None else d["q_lora_rank"] * (h + heads * qk)
    attn = q + h * (lat + rope) + lat * heads * (d["qk_nope_head_dim"] + d["v_head_dim"]) + heads * d["v_head_dim"] * h
    dense, moe_i = 3 * h * d["intermediate_size"], 3 * h * d["moe_intermediate_size"]
    moe = (d["n_routed_experts"] + d["n_shared_experts"]) * moe_i + d["n_routed_experts"] * h
    k = d["first_k_dense_replace"]
    return total + n * attn + k * dense + (n - k) * moe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu-gb", type=float, default=80.0, help="without a GPU: its memory in GB (1e9 bytes)")
    ap.add_argument("--fraction", type=float, default=0.9, help="of the GPU's memory for weights and KV cache")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    memory = torch.cuda.mem_get_info()[1] if gpu else int(args.gpu_gb * 1e9)
    name = torch.cuda.get_device_name() if gpu else f"{args.gpu_gb:g} GB (no GPU here)"
    rows = []
    for label, d in (("DeepSeek-V2-Lite (MLA)", V2_LITE), ("Llama-shaped GQA, same parameters", GQA_16B),
                     ("DeepSeek-V3 (MLA), for scale", V3)):  # fmt: skip
        per_token = ModelConfig.from_dict(dict(d, torch_dtype="bfloat16")).kv_bytes_per_token
        p = params(d)
        room = memory * args.fraction - 2 * p
        rows.append(dict(model=label, params_b=round(p / 1e9, 2), kv_bytes_per_token=per_token,
                         tokens_that_fit=max(0, int(room // per_token))))  # fmt: skip
    print(f"{name}: {memory / 1e9:.1f} GB, {args.fraction:g} of it for bf16 weights and the KV cache")
    print(f"{'model':36} {'params (B)':>10} {'KV B/token':>11} {'tokens that fit':>16}")
    for r in rows:
        print(f"{r['model']:36} {r['params_b']:>10} {r['kv_bytes_per_token']:>11,} {r['tokens_that_fit']:>16,}")
    mla, gqa = rows[0], rows[1]
    print(f"MLA holds {mla['tokens_that_fit'] / max(gqa['tokens_that_fit'], 1):.2f}x the GQA model's tokens "
          f"({gqa['kv_bytes_per_token'] / mla['kv_bytes_per_token']:.2f}x fewer bytes a token)")  # fmt: skip
    if args.out:
        json.dump(dict(device=name, memory=memory, fraction=args.fraction, rows=rows), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
