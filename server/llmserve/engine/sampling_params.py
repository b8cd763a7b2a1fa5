"""Per-request generation settings, as the engine sees them.

Protocol layers (native, OpenAI) map their fields and defaults onto these:
native `max_dec_len`/`min_dec_len`/`topp`/`penalty_score`/`frequency_score`/
`presence_score` become `max_tokens`/`min_tokens`/`top_p`/
`repetition_penalty`/`frequency_penalty`/`presence_penalty`. A repetition penalty left unset
is the model's own default (its generation_config.json, as Hugging Face models ship one).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 1
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    # penalty_score: logits of tokens seen in prompt or output are divided
    # (positive) or multiplied (negative) by it, as in CTRL / HF. None: the model's default
    # (LLMEngine fills it in from generation_config.json: model_repetition_penalty), else 1.0.
    repetition_penalty: float | None = None
    # frequency_score / presence_score: logit -= freq * count + pres * (count > 0),
    # counting output tokens only.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: chosen token + top k
    # Log-probabilities of the prompt's tokens (each given the ones before it; the first has none):
    # None: off; k >= 0: the prompt token + top k. Such a request computes its whole prompt (no prefix cache).
    prompt_logprobs: int | None = None
    # Added to the logits of these token ids before any penalty, temperature or cut (OpenAI's
    # logit_bias: -100 all but bans a token, 100 all but forces it).
    logit_bias: dict[int, float] = field(default_factory=dict)
    include_stop_str_in_output: bool = False
    # Structured output: an llguidance grammar (protocol/structured.py) every sampled token must follow;
    # the output ends when it is complete (engine/structured.py).
    grammar: str | None = None
    # OpenAI's predicted output (`prediction`): text the output will mostly repeat, and its token ids
    # (protocol/native.py tokenizes it where the prompt is tokenized); the engine may use them as
    # speculative proposals. Empty: none.
    prediction: str | None = None
    prediction_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    def as_dict(self) -> dict:
        """The fields, for a message that rebuilds them (`SamplingParams(**d)`): a flat copy, its lists and
        dicts shared (dataclasses.asdict's deep copy cost the engine server 0.08 ms a request)."""
        return {k: getattr(self, k) for k in _FIELDS}

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or top-1 sampling (the same token, without the sort)."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def repetition(self) -> float:
        """The repetition penalty in force: 1.0 (none) while unset, before the engine fills in the model's."""
        return self.repetition_penalty or 1.0

    @property
    def penalised(self) -> bool:
        """A repetition, frequency or presence penalty applies (its counts must be kept)."""
        return self.repetition != 1.0 or bool(self.frequency_penalty) or bool(self.presence_penalty)

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why}")

        if self.max_tokens < 1:
            bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            bad("min_tokens", f"{self.min_tokens} exceeds max_tokens {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad("top_k", f"must be >= 0, got {self.top_k}")
        rep = self.repetition_penalty
        if rep is not None and (not math.isfinite(rep) or rep <= 0):
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                bad(name, "must be finite")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}")
        for tok, bias in self.logit_bias.items():
            if not (isinstance(tok, int) and tok >= 0):
                bad("logit_bias", f"token ids must be integers >= 0, got {tok!r}")
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                bad("logit_bias", f"biases must be in [-100, 100], got {bias!r} for token {tok}")
        if self.seed is not None and self.seed < 0:
            bad("seed", f"must be >= 0, got {self.seed}")  # one rule on every protocol (engine/draw.py takes any int)
        if any(not (isinstance(t, int) and t >= 0) for t in self.prediction_token_ids):
            bad("prediction_token_ids", "token ids must be integers >= 0")
        if any(not s for s in self.stop):
            bad("stop", "empty stop string")


_FIELDS = tuple(f.name for f in fields(SamplingParams))


def model_repetition_penalty(model_dir: str | Path) -> float:
    """The model's default repetition penalty: generation_config.json's `repetition_penalty`, which
    Hugging Face's `generate` applies too, else 1.0 (none). A request's own value overrides it."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return 1.0
    value = json.loads(path.read_text(encoding="utf-8")).get("repetition_penalty")
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{path}: repetition_penalty must be a number > 0, got {value!r}")
    return float(value)
