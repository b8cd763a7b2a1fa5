"""A request's life inside the engine: tokens, KV blocks, status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llmserve.engine.output import TokenLogprobs

PENDING = -1  # the id of a token sampled by a step still in flight


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens reached (or the model's length)
    ABORT = "abort"  # cancelled, timed out or failed


@dataclass
class Request:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens sampled by a step still in flight (overlapped scheduling): counted in num_tokens, their
    # ids not known yet. A runner fills them in from its own last output (PENDING in token ids).
    num_pending: int = 0
    # Tokens whose KV is in the cache (computed this life or found in the prefix cache).
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt, served by the prefix cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of the leading full blocks, for prefix caching
    num_table_trims: int = 0  # times block_table shrank (freed, rolled back): other ranks resend it whole
    num_preemptions: int = 0
    # Tokens proposed to follow its last one (speculative decoding), verified in its next step.
    draft_token_ids: list[int] = field(default_factory=list)
    # Their proposal distribution q (a draft model's; a [k, V] float32 device tensor, row j for draft j),
    # verified by rejection sampling against it; None: no q (n-gram, greedy), the one-hot path.
    draft_probs: Any = None
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    # Prompt logprobs gathered over its prefill steps (entry p: token p given the tokens before it;
    # entry 0 stays None), handed out whole with its first token. None when not asked for.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_generated(self) -> int:
        """Output tokens sampled so far, those in flight included: the index of the next one."""
        return len(self.output_token_ids) + self.num_pending

    def done_sampling(self, max_model_len: int) -> bool:
        """Whether the tokens sampled (in flight included) already end it by length: nothing more to run."""
        return self.num_generated >= self.params.max_tokens or self.num_tokens >= max_model_len

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs, not handed out yet (they go with the first token): its prompt
        positions must be computed (no prefix cache) and their logprobs returned."""
        return self.params.prompt_logprobs is not None and self.first_token_time is None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output (+ PENDING for those in flight), without concatenating."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        known = n + len(self.output_token_ids)
        if start >= n and stop <= known:
            return self.output_token_ids[start - n : stop - n]
        out = self.prompt_token_ids[start:] + self.output_token_ids[max(0, start - n) : stop - n]
        return out + [PENDING] * (stop - max(start, known))

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
