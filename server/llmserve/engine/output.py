"""What the engine reports after each step, per request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    logprob: float  # of the sampled token
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class RequestOutput:
    req_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token (the first None), whole, on the
    # request's first output (the one with its first token); None on every other output.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None
    # Seconds since arrival of the first token (set on the output that carries it).
    ttft: float | None = None
