"""Which model class serves an architecture (ModelConfig.architecture), and building it.

A class may define `check_settings(cfg, config, device)`, raising ConfigError for settings it cannot serve:
it runs before any weight is read, so a refusal names the setting at start.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmserve.config import Config
from llmserve.layers.model_config import ModelConfig
from llmserve.layers.parallel import SINGLE, TensorParallel
from llmserve.layers.quant.methods import LinearMethod
from llmserve.models.deepseek import DeepseekModel
from llmserve.models.llama import DecoderModel

MODELS: dict[str, type] = {
    "llama": DecoderModel,
    "qwen2": DecoderModel,
    "deepseek_v3": DeepseekModel,
    "deepseek_v2": DeepseekModel,
}


def model_class(architecture: str) -> type:
    if architecture not in MODELS:
        raise ValueError(f"no model class serves architecture {architecture!r} (known: {', '.join(MODELS)})")
    return MODELS[architecture]


def build_model(
    cfg: ModelConfig,
    model_dir: str | Path,
    config: Config,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    method: LinearMethod | None = None,
    tp: TensorParallel = SINGLE,
):
    """The model of `cfg`'s architecture over the checkpoint in `model_dir`, once its class accepts `config`."""
    cls = model_class(cfg.architecture)
    if (check := getattr(cls, "check_settings", None)) is not None:
        check(cfg, config, device)
    return cls(cfg, model_dir, device, dtype, max_positions, method, tp)
