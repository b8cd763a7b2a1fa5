"""The composition root: the runner (or tensor-parallel executor) for a model directory, its tokenizer,
and the engine over them. The engine and the runners know nothing of each other's construction."""

from __future__ import annotations

import logging

from llmserve.config import Config
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.sampling_params import model_repetition_penalty
from llmserve.runners.model_dir import resolve_model_dir, runner_kind

log = logging.getLogger(__name__)


def load_model(config: Config):
    """(runner, tokenizer, the model directory it resolved to) for config.model_dir."""
    from llmserve.engine.tokenizer import load_tokenizer

    model_dir = resolve_model_dir(config)
    kind = runner_kind(model_dir, config)
    if config.mp_num > 1:  # rank 0 of a tensor-parallel group (either runner): the engine drives its executor
        from llmserve.executor.executor import start_executor

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
    return runner, tokenizer, model_dir


def engine_over(config: Config, runner, model_dir, tokenizer=None, grammar_tokenizer=None) -> LLMEngine:
    """The engine over a loaded model, with the model directory's decoding default (generation_config.json)."""
    return LLMEngine(
        config, runner, tokenizer, grammar_tokenizer, default_repetition_penalty=model_repetition_penalty(model_dir)
    )


def build_engine(config: Config) -> LLMEngine:
    """Load the model of `config.model_dir` (the demo model when none) with the right runner."""
    runner, tokenizer, model_dir = load_model(config)
    return engine_over(config, runner, model_dir, tokenizer)
