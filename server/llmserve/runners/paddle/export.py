"""Export a Llama/Qwen2 model to a Paddle static graph: from a HF checkpoint or random weights.

Output directory (docs/model_format.md):
    config.json                 ModelConfig.to_hf_dict() (dtype float32: the graph computes in float32)
    generation_config.json      copied from the checkpoint, or bos/eos for random weights
    tokenizer files             copied from the checkpoint (export_random keeps what is there)
    rank_0/model.json           the paged PIR program (`graph.build_paged_program`)
    rank_0/model.pdiparams      its weights, float32, Paddle [in, out] layout, q/k/v and gate/up fused
With mp > 1 (export_mp.py): rank_0 ... rank_{mp-1}, each with a tp.json, and rank_mapping.csv.
Safetensors are read with numpy alone (no torch), bf16/fp16 widened to float32.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import paddle

from llmserve.layers.model_config import ModelConfig
from llmserve.models.layout import detect_model_format  # noqa: F401 - re-exported for callers
from llmserve.runners.paddle.export_mp import check_mp, rank_shards, write_rank_files, write_rank_mapping
from llmserve.runners.paddle.graph import LlamaPaddle, build_paged_program, param_shapes, random_weights
from llmserve.utils.safetensors_files import SafetensorsFiles, checkpoint_files

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf", ".ckpt")


def hf_weight_files(hf_dir: Path) -> list[Path]:
    return checkpoint_files(hf_dir)


class SafetensorsReader(SafetensorsFiles):
    """Tensors of one or more .safetensors files by name, as float32 (utils/safetensors_files.py)."""

    def get(self, name: str) -> np.ndarray:
        return self.as_float32(name)


def _check_supported(raw: dict) -> None:
    problems = []
    if raw.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={raw['hidden_act']!r} (only silu)")
    if raw.get("mlp_bias"):
        problems.append("mlp_bias=true")
    if raw.get("use_sliding_window"):
        problems.append("use_sliding_window=true")
    if problems:
        raise ValueError("unsupported model config: " + ", ".join(problems))


def load_hf_weights(hf_dir: str | Path, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """HF Llama/Qwen2 tensors mapped onto `param_shapes(cfg)` (transposed to [in, out], fused)."""
    st = SafetensorsReader(hf_weight_files(Path(hf_dir)))

    def get(name: str) -> np.ndarray:
        if name not in st:
            raise KeyError(f"checkpoint {hf_dir} has no tensor {name!r}")
        return st.get(name)

    def linear(*names: str) -> np.ndarray:  # HF [out, in] -> ours [in, out], fused along out
        return np.ascontiguousarray(np.concatenate([get(n) for n in names], axis=0).T)

    out: dict[str, np.ndarray] = {
        "rope.inv_freq": cfg.inv_freq(),
        "embed_tokens.weight": get("model.embed_tokens.weight"),
    }
    for i in range(cfg.num_hidden_layers):
        hf, p = f"model.layers.{i}.", f"layers.{i}."
        qkv = [hf + f"self_attn.{x}_proj" for x in "qkv"]
        out[p + "input_layernorm.weight"] = get(hf + "input_layernorm.weight")
        out[p + "self_attn.qkv_proj.weight"] = linear(*(n + ".weight" for n in qkv))
        if cfg.attention_bias:
            out[p + "self_attn.qkv_proj.bias"] = np.concatenate([get(n + ".bias") for n in qkv])
        out[p + "self_attn.o_proj.weight"] = linear(hf + "self_attn.o_proj.weight")
        if p + "self_attn.o_proj.bias" in param_shapes(cfg):
            out[p + "self_attn.o_proj.bias"] = get(hf + "self_attn.o_proj.bias")
        out[p + "post_attention_layernorm.weight"] = get(hf + "post_attention_layernorm.weight")
        out[p + "mlp.gate_up_proj.weight"] = linear(hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")
        out[p + "mlp.down_proj.weight"] = linear(hf + "mlp.down_proj.weight")
    out["norm.weight"] = get("model.norm.weight")
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = linear("lm_head.weight")
    return out


def save_static(
    cfg: ModelConfig,
    weights: dict[str, np.ndarray],
    out_dir: str | Path,
    rank: int = 0,
    model: Callable[[ModelConfig, dict], LlamaPaddle] = LlamaPaddle,
) -> Path:
    """Trace the paged graph of `model`, load `weights` into it and save rank_{rank}/model.json + model.pdiparams.

    For one rank of a sharded export, `cfg` is that rank's local config (export_mp.RankShard)."""
    shapes = param_shapes(cfg)
    for name, shape in shapes.items():
        if list(weights[name].shape) != shape:
            raise ValueError(f"weight {name}: shape {list(weights[name].shape)}, expected {shape}")
    prefix = Path(out_dir) / f"rank_{rank}" / "model"
    was_dynamic = paddle.in_dynamic_mode()
    paddle.enable_static()
    try:
        main, startup, feeds, logits = build_paged_program(cfg, model)
        scope, place = paddle.static.Scope(), paddle.CPUPlace()
        with paddle.static.scope_guard(scope):
            exe = paddle.static.Executor(place)
            exe.run(startup)
            for name in shapes:
                scope.find_var(name).get_tensor().set(np.ascontiguousarray(weights[name], np.float32), place)
            paddle.static.save_inference_model(str(prefix), feeds, [logits], exe, program=main)
    finally:
        if was_dynamic:
            paddle.disable_static()
    program = prefix.with_suffix(".json")
    inplace = program.read_text().count('"1.scatter_"')
    if inplace != 2 * cfg.num_hidden_layers:  # a Paddle upgrade that drops in-place ops must fail loudly
        raise RuntimeError(f"{program}: expected {2 * cfg.num_hidden_layers} in-place cache writes, found {inplace}")
    return prefix.parent


def _write_config(cfg: ModelConfig, out_dir: Path) -> None:
    cfg32 = dataclasses.replace(cfg, dtype="float32")
    (out_dir / "config.json").write_text(json.dumps(cfg32.to_hf_dict(), indent=2, sort_keys=True) + "\n")


def _remove_stale_ranks(out: Path, mp: int) -> None:
    """Drop rank dirs of an earlier export with more ranks: the runner counts rank_* to check MP_NUM."""
    for d in out.glob("rank_*"):
        m = re.fullmatch(r"rank_(\d+)", d.name)
        if m and int(m.group(1)) >= mp and d.is_dir():
            shutil.rmtree(d)
    if mp == 1:
        (out / "rank_mapping.csv").unlink(missing_ok=True)
        (out / "rank_0" / "tp.json").unlink(missing_ok=True)


def export_weights(cfg: ModelConfig, weights: dict[str, np.ndarray], out_dir: str | Path, mp: int = 1) -> Path:
    """config.json + rank_0/ (rank_0 ... rank_{mp-1}/ with mp > 1) for the given full weights (in
    `param_shapes` layout); other files are kept."""
    check_mp(cfg, mp)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _remove_stale_ranks(out, mp)
    if mp == 1:
        save_static(cfg, weights, out)
    else:
        for shard in rank_shards(cfg, mp):
            save_static(shard.local_config(), shard.shard_weights(weights), out, shard.rank, shard.model())
            write_rank_files(out, shard)
        write_rank_mapping(out, mp)
    _write_config(cfg, out)
    return out


def export_random(model_config: ModelConfig, out_dir: str | Path, seed: int = 0, mp: int = 1) -> Path:
    """A model with seeded random weights; files are identical byte for byte for the same seed.

    Files already in out_dir (tokenizer) are kept. mp > 1: sharded over mp ranks (export_mp.py).
    """
    out = export_weights(model_config, random_weights(model_config, seed), out_dir, mp)
    gen = out / "generation_config.json"
    if not gen.exists():
        eos = list(model_config.eos_token_ids)
        gen_cfg = {"bos_token_id": model_config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos}
        gen.write_text(json.dumps(gen_cfg, indent=2, sort_keys=True) + "\n")
    return out


def export_hf(hf_dir: str | Path, out_dir: str | Path, mp: int = 1) -> Path:
    """Export a HF Llama/Qwen2 safetensors checkpoint; tokenizer and generation config are copied.

    mp > 1: one graph per rank, sharded Megatron style (export_mp.py)."""
    src, out = Path(hf_dir), Path(out_dir)
    raw = json.loads((src / "config.json").read_text())
    _check_supported(raw)
    cfg = ModelConfig.from_dict(raw)
    if cfg.mla is not None:  # the static graph holds Llama's GQA attention and dense MLP only
        raise ValueError(
            f"{cfg.architecture}: the Paddle static-graph exporter does not express MLA attention or mixture-of-"
            "experts layers; serve this model with the torch runner (LLMSERVE_RUNNER=torch)"
        )
    check_mp(cfg, mp)  # before reading the weights
    export_weights(cfg, load_hf_weights(src, cfg), out, mp)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(WEIGHT_SUFFIXES + (".index.json",)):
            shutil.copy2(f, out / f.name)
    return out
