"""Which model directory is served and which runner serves it.

A directory with rank_0/model.json or rank_0/model.pdmodel is a Paddle static
graph (paddle runner); one with *.safetensors is a HF checkpoint (torch
runner). With no model directory, the demo model is built once into a cache
directory and served.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from llmserve.config import Config

log = logging.getLogger(__name__)


def demo_model_dir(config: Config | None = None) -> Path:
    """Where the demo model's static graph lives: LLMSERVE_CACHE_DIR/demo-<its weights' digest> (of
    `config`, else of the environment), so a new demo never meets an old cache."""
    from llmserve.models.demo import DEMO_SHA256

    return (config or Config.from_env()).cache_path / f"demo-{DEMO_SHA256[:12]}"


def ensure_demo_model(config: Config | None = None) -> Path:
    """Export the demo model into the cache directory unless it is there already."""
    from llmserve.runners.paddle.demo import export_demo

    out = demo_model_dir(config)
    if not (out / "rank_0" / "model.pdiparams").exists():
        log.info("exporting the demo model into %s", out)
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        export_demo(tmp)
        try:
            tmp.rename(out)  # whole or not at all: a concurrent start may have written it first
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    _refresh_tokenizer_config(out)
    return out


def _refresh_tokenizer_config(out: Path) -> None:
    """The cache is named after the demo's weights; its chat template may have changed since (tools were
    added to it): the cached copy follows the package's."""
    from llmserve.models.demo import DEMO_HF_DIR

    src, dst = DEMO_HF_DIR / "tokenizer_config.json", out / "tokenizer_config.json"
    if dst.exists() and dst.read_bytes() != src.read_bytes():
        tmp = dst.with_name(f"{dst.name}.tmp{os.getpid()}")
        shutil.copyfile(src, tmp)
        tmp.replace(dst)


def resolve_model_dir(config: Config) -> Path:
    d = config.model_dir
    if not d or (d.rstrip("/") == "/models" and not Path(d).is_dir()):
        return ensure_demo_model(config)
    if not Path(d).is_dir():
        raise FileNotFoundError(f"MODEL_DIR {d!r} is not a directory")
    return Path(d)


def runner_kind(model_dir: str | Path, config: Config) -> str:
    """ "paddle" or "torch": LLMSERVE_RUNNER, else the model directory's format."""
    from llmserve.models.layout import detect_model_format

    if config.runner != "auto":
        return config.runner
    return "paddle" if detect_model_format(str(model_dir)) == "paddle" else "torch"
