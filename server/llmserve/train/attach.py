"""`llmserve train --init-from DIR --mtp`: an MTP module trained alone on a trained, frozen trunk.

The trunk (every tensor of DIR's `model.safetensors` outside `model.layers.{L}.`, L =
num_hidden_layers) is loaded into the model the preset builds, frozen (no gradients, no optimizer
state, no weight decay) and written back unchanged: OUT's trunk tensors are DIR's, bit for bit.
Only the MTP module (`mtp.MTPLayer`, initialised as in a joint `--mtp` run of the same seed) trains,
on the MTP loss alone. A DIR that already holds an MTP module gets a new one in OUT.

OUT holds DIR's tokenizer and generation config, DIR's `config.json` with
`num_nextn_predict_layers: 1`, the trunk + MTP tensors, DIR's `train_log.jsonl` followed by the MTP
run's lines (`"phase": "mtp"`), and DIR's `train_metrics.json` (the trunk's numbers) with the MTP
run's under `"mtp"` and its held-out MTP metrics (`mtp_heldout_ppl`, `mtp_top1`,
`mtp_agrees_with_trunk`) at the top level, where a joint run writes them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from llmserve.train.mtp import MTPLayer, checkpoint_tensors
from llmserve.train.presets import Preset

SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)
MTP_METRICS = ("mtp_heldout_ppl", "mtp_top1", "mtp_agrees_with_trunk")


def check_options(opts, preset: Preset) -> None:
    """The refusals of --init-from, before any work is done: flags, DIR, and DIR's shape against the preset."""
    if opts.init_from is None:
        return
    src = Path(opts.init_from)
    if preset.deepseek is not None:
        raise ValueError(f"--init-from: preset {preset.name} is a DeepSeek model; --init-from takes Llama trunks")
    if not opts.mtp:
        raise ValueError("--init-from trains only an MTP module on the frozen model: give --mtp too")
    if opts.tokenizer is not None or opts.tokenizer_only:
        raise ValueError("--init-from DIR uses DIR's tokenizer: drop --tokenizer / --tokenizer-only")
    if not (src / "config.json").is_file() or not (src / "model.safetensors").is_file():
        raise FileNotFoundError(f"--init-from {src}: no config.json and model.safetensors (an HF checkpoint)")
    if src.resolve() == Path(opts.out).resolve():
        raise ValueError(
            f"--init-from {src}: --out must be another directory (the source is read while OUT is written)"
        )
    raw = json.loads((src / "config.json").read_text())
    want = {f: getattr(preset, f) for f in SHAPE_FIELDS}
    got = {f: raw.get(f) for f in want}
    if raw.get("model_type") != "llama" or got != want:
        diff = ", ".join(f"{f} {got[f]} (preset: {want[f]})" for f in want if got[f] != want[f])
        raise ValueError(
            f"--init-from {src}: its model does not match --preset {preset.name}: "
            + (diff or f"model_type {raw.get('model_type')!r}, not 'llama'")
        )


def source_config(src: Path, vocab_size: int) -> LlamaConfig:
    """DIR's config, with num_nextn_predict_layers 1 (its shape was checked by `check_options`)."""
    config = LlamaConfig.from_pretrained(src, attn_implementation="sdpa")
    if config.vocab_size != vocab_size:
        raise ValueError(f"--init-from {src}: vocab_size {config.vocab_size}, its tokenizer has {vocab_size} ids")
    config.num_nextn_predict_layers = 1
    return config


def trunk_tensors(src: Path, num_hidden_layers: int) -> dict[str, torch.Tensor]:
    """DIR's tensors without its MTP layers (model.layers.{L}. and beyond), as stored."""
    tensors = load_file(str(src / "model.safetensors"))

    def is_mtp(name: str) -> bool:
        parts = name.split(".")
        return name.startswith("model.layers.") and int(parts[2]) >= num_hidden_layers

    return {k: v for k, v in tensors.items() if not is_mtp(k)}


def load_frozen_trunk(model: LlamaForCausalLM, trunk: dict[str, torch.Tensor]) -> None:
    """DIR's trunk into `model`, whose parameters then take no gradients."""
    missing, unexpected = model.load_state_dict(trunk, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"--init-from: tensors missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    model.requires_grad_(False)
    model.eval()


def save_attached(
    out: Path,
    src: Path,
    trunk: dict[str, torch.Tensor],
    model: LlamaForCausalLM,
    mtp: MTPLayer,
    copies: bool,
    dtype: str = "float32",
) -> None:
    """OUT's checkpoint: DIR's trunk tensors as read, the MTP's in `dtype` (`copies`: with the MTP layer's
    copies of the embedding and LM head, `mtp.checkpoint_tensors`), DIR's config + num_nextn_predict_layers."""
    state = model.state_dict()  # float32: a bf16 trunk widened, which is exact
    changed = [k for k, v in trunk.items() if not torch.equal(state[k].detach().cpu().to(v.dtype), v)]
    if changed:  # the trunk is frozen: this is a bug, not a training outcome
        raise RuntimeError(f"the frozen trunk changed during training: {changed[:5]}")
    tensors = dict(trunk)
    for k, v in checkpoint_tensors(mtp, model, copies).items():
        tensors[k] = v.detach().to("cpu", getattr(torch, dtype)).clone().contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if (src / "generation_config.json").is_file():
        shutil.copyfile(src / "generation_config.json", out / "generation_config.json")


def source_log_lines(src: Path) -> list[str]:
    """DIR's train_log.jsonl lines of its trunk's training (an earlier MTP run's are dropped)."""
    path = src / "train_log.jsonl"
    if not path.is_file():
        return []
    return [line + "\n" for line in path.read_text().splitlines() if json.loads(line).get("phase") != "mtp"]


def merge_metrics(src: Path, run: dict, ev: dict) -> dict:
    """DIR's train_metrics.json (the trunk's), with this run's under "mtp" and its MTP metrics on top.

    `run` describes the MTP run; `ev` is its final evaluation, whose trunk numbers (heldout_ppl,
    heldout_top1) are the frozen trunk's, measured again, and go in as trunk_heldout_ppl / _top1."""
    path = src / "train_metrics.json"
    metrics = json.loads(path.read_text()) if path.is_file() else {}
    for k in ("heldout_ppl", "heldout_top1", "heldout_tokens", "heldout_windows", "params", "vocab_size"):
        metrics.setdefault(k, ev.get(k, run.get(k)))
    section = {k: v for k, v in run.items() if k not in ("params", "vocab_size", "mtp")}
    section["init_from"] = str(src)
    section["frozen_trunk"] = True
    section["trunk_heldout_ppl"] = ev["heldout_ppl"]
    section["trunk_heldout_top1"] = ev["heldout_top1"]
    section.update({k: ev[k] for k in (*MTP_METRICS, "heldout_tokens", "heldout_windows")})
    metrics["mtp"] = section
    metrics["mtp_params"] = run["mtp_params"]
    metrics.update({k: ev[k] for k in MTP_METRICS})
    return metrics
