"""The records of the engine core's step messages (engine_core.py's wire), named once here: msgpack carries
a record as an array (compact: no key strings per token), and each side reads it by name."""

from __future__ import annotations

from typing import NamedTuple


class CoreOut(NamedTuple):
    """One request's output of one step."""

    req_id: str
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list | None  # [[logprob, [[token_id, logprob], ...]], ...], one per new token
    error: str | None
    prompt_logprobs: list | None  # as logprobs, None for positions without one


class KvLoad(NamedTuple):
    """The engine's load after a step."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
