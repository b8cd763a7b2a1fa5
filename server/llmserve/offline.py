"""Offline generation: `LLM(model_dir).generate(prompts, params)`.

All prompts go through the engine at once (continuous batching), exactly as
served requests do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from llmserve.config import Config
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.runner_contract import TokenLogprobs
from llmserve.engine.sampling_params import SamplingParams
from llmserve.serving.compose import build_engine


@dataclass
class GenerationResult:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # SamplingParams.prompt_logprobs: one per prompt token (the first None); None when not asked for.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if self.prompt_logprobs is None:
            del d["prompt_logprobs"]
        return d


class LLM:
    def __init__(self, model_dir: str = "", config: Config | None = None, **overrides) -> None:
        config = config or Config.from_env()
        self.config = dataclasses.replace(config, model_dir=model_dir or config.model_dir, **overrides)
        self.engine: LLMEngine = build_engine(self.config)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[GenerationResult]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        results: dict[str, GenerationResult] = {}
        order = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            if isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt)
                res = GenerationResult(prompt, ids)
            else:
                ids = list(prompt)
                res = GenerationResult(None, ids)
            rid = f"offline-{i}"
            self.engine.add_request(rid, ids, dataclasses.replace(p))
            results[rid] = res
            order.append(rid)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(order), desc="generate", unit="req")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                res = results[out.req_id]
                res.token_ids.extend(out.new_token_ids)
                res.text += out.new_text
                if out.prompt_logprobs is not None:
                    res.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    res.finish_reason = out.finish_reason
                    if bar:
                        bar.update()
        if bar:
            bar.close()
        return [results[r] for r in order]

    def shutdown(self) -> None:
        self.engine.shutdown()
