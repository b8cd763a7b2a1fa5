"""Write a trained model as a Hugging Face directory that transformers, the torch runner and the
exporter read: config.json, model.safetensors (one file; float32, or the preset's `save_dtype`),
generation_config.json. A DeepSeek preset's (`model_config`: DeepseekV3ForCausalLM) experts are written one
by one under DeepSeek-V3's names (`experts.{e}.gate_proj.weight` ...), as its checkpoints hold them,
not as transformers' stacked training tensors.

With an MTP module, config.json gets `num_nextn_predict_layers: 1` and the module's weights
follow the last decoder layer under DeepSeek-V3's names (`mtp.checkpoint_tensors`).
transformers' LlamaForCausalLM reports them as unexpected keys and skips them; the torch runner
and the exporter read layers 0 .. num_hidden_layers - 1 by name and never look at them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

from llmserve.train.mtp import MTPLayer, checkpoint_tensors


def _common(preset, vocab_size: int, bos_id: int, eos_ids: tuple[int, ...]) -> dict:
    """The fields both families' configs take alike."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        max_position_embeddings=preset.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=preset.tie_word_embeddings,
        hidden_act="silu",
        attention_bias=False,
        initializer_range=0.02,
        bos_token_id=bos_id,
        eos_token_id=list(eos_ids),
        pad_token_id=None,
        attn_implementation="sdpa",
    )


def model_config(preset, vocab_size: int, bos_id: int, eos_ids: tuple[int, ...], mtp: bool) -> PretrainedConfig:
    """The preset's transformers config: Llama's, or DeepSeek-V3's for a preset with `deepseek`."""
    if preset.deepseek is None:
        return llama_config(preset, vocab_size, bos_id, eos_ids, mtp)
    ds = preset.deepseek
    return DeepseekV3Config(
        architectures=["DeepseekV3ForCausalLM"],
        **_common(preset, vocab_size, bos_id, eos_ids),
        num_key_value_heads=preset.num_attention_heads,
        moe_intermediate_size=ds.moe_intermediate_size,
        n_shared_experts=ds.n_shared_experts,
        n_routed_experts=ds.n_routed_experts,
        num_experts_per_tok=ds.num_experts_per_tok,
        routed_scaling_factor=ds.routed_scaling_factor,
        kv_lora_rank=ds.kv_lora_rank,
        q_lora_rank=ds.q_lora_rank,
        qk_nope_head_dim=ds.qk_nope_head_dim,
        qk_rope_head_dim=ds.qk_rope_head_dim,
        v_head_dim=ds.v_head_dim,
        n_group=ds.n_group,
        topk_group=ds.topk_group,
        first_k_dense_replace=ds.first_k_dense_replace,
        norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": preset.rope_theta},
        rope_interleave=True,
        topk_method="noaux_tc",  # what transformers' router does (DeepSeek-V3's names, for other readers)
        scoring_func="sigmoid",
        num_nextn_predict_layers=1 if mtp else 0,
    )


def llama_config(preset, vocab_size: int, bos_id: int, eos_ids: tuple[int, ...], mtp: bool) -> LlamaConfig:
    extra = {"num_nextn_predict_layers": 1} if mtp else {}
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        **_common(preset, vocab_size, bos_id, eos_ids),
        num_key_value_heads=preset.num_key_value_heads,
        head_dim=preset.head_dim,
        rope_theta=preset.rope_theta,
        mlp_bias=False,
        **extra,
    )


def causal_lm(config: PretrainedConfig) -> PreTrainedModel:
    """A freshly initialised model of `config`'s family (transformers' own classes)."""
    return (DeepseekV3ForCausalLM if config.model_type == "deepseek_v3" else LlamaForCausalLM)(config)


def per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' stacked expert tensors (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
    [E, H, I]) as DeepSeek-V3's checkpoints name them, one expert at a time; other tensors as they are."""
    out = {}
    for k, v in tensors.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            p = k[: -len("gate_up_proj")]
            for e, w in enumerate(v):
                gate, up = w.chunk(2, dim=0)
                out[f"{p}{e}.gate_proj.weight"], out[f"{p}{e}.up_proj.weight"] = gate, up
        elif k.endswith("mlp.experts.down_proj"):
            p = k[: -len("down_proj")]
            for e, w in enumerate(v):
                out[f"{p}{e}.down_proj.weight"] = w
        else:
            out[k] = v
    return out


def _config_dict(config: PretrainedConfig, dtype: str = "float32") -> dict:
    d = config.to_dict()  # every field (not only those that differ from the defaults): other readers need them
    for generic in ("_attn_implementation_autoset", "_name_or_path", "id2label", "label2id", "problem_type"):
        d.pop(generic, None)  # PretrainedConfig's task fields: noise in a causal LM's config
    d["torch_dtype"] = d["dtype"] = dtype
    return d


def save_checkpoint(
    out: Path,
    model: PreTrainedModel,
    mtp: MTPLayer | None = None,
    dtype: str = "float32",
    repetition_penalty: float | None = None,
) -> Path:
    """Write config.json, model.safetensors and generation_config.json into `out` (with the decoding default
    `repetition_penalty` when given: the server and HF's generate apply it where a request sets none)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # the embedding (safetensors stores no aliases)
    if mtp is not None:
        tensors.update(checkpoint_tensors(mtp, model))
    # clone: tied and shared tensors become separate buffers, as safetensors requires; the router and its
    # score-correction bias stay float32 (transformers keeps them so)
    keep = ("mlp.gate.weight", "e_score_correction_bias")
    tensors = {
        k: v.detach().to("cpu", torch.float32 if k.endswith(keep) else getattr(torch, dtype)).clone().contiguous()
        for k, v in per_expert(tensors).items()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config
    (out / "config.json").write_text(json.dumps(_config_dict(cfg, dtype), indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
    if repetition_penalty is not None:
        gen["repetition_penalty"] = repetition_penalty
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    return out
