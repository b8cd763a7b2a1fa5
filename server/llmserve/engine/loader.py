"""Pick the runner for a model directory and load model + tokenizer.

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
    from llmserve.models.demo import export_demo

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


def load_model(config: Config):
    """(runner, tokenizer) for config.model_dir."""
    from llmserve.engine.tokenizer import load_tokenizer

    model_dir = resolve_model_dir(config)
    kind = runner_kind(model_dir, config)
    if config.mp_num > 1:  # rank 0 of a tensor-parallel group (either runner): the engine drives its executor
        from llmserve.dist.executor import start_executor

        runner = start_executor(str(model_dir), config)
    elif kind == "paddle":
        from llmserve.engine.sampler import Sampler
        from llmserve.runners.paddle.runner import PaddleRunner

        runner = PaddleRunner(str(model_dir), config, Sampler(config.seed))
    else:
        from llmserve.runners.torch.runner import TorchRunner

        runner = TorchRunner(str(model_dir), config)
    tokenizer = load_tokenizer(str(model_dir), use_hf=config.use_hf_tokenizer)
    log.info(
        "loaded %s with the %s runner: %d KV blocks of %d tokens",
        model_dir,
        kind,
        runner.num_kv_blocks,
        runner.block_size,
    )
    return runner, tokenizer
