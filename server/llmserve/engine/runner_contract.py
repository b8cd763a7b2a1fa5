"""The contract between the engine and a model runner.

The engine decides *what* runs (which tokens of which requests, in which KV
blocks); a runner decides *how*: it owns the weights, the KV cache and the
sampler, so a CUDA runner can keep penalties, seeds and sampling on the device
and replay CUDA graphs without the engine changing.

One `execute` call runs one step over a mixed batch: prefill chunks (many
tokens of one request, causal among themselves and attending to the cached
prefix) and decode tokens (one token each). Every chunk writes its tokens'
K/V into the request's blocks: token at position p lives in slot
`block_table[p // block_size] * block_size + p % block_size`.

Speculative decoding: a sampling chunk may carry `draft_token_ids`, k tokens proposed to follow
its last token. They are appended to the chunk's tokens (its K/V written like any other), and the
runner verifies them: it samples a token at each of the last k + 1 positions exactly as it would
without speculation (row j: penalties counting the drafts before it, output index + j for seeds and
min_tokens), keeps the drafts up to the first one that differs from the token sampled at its
position, and returns those plus the token sampled right after them (the correction, or the bonus
token when all k were kept): 1..k+1 tokens. Keeping draft j exactly when the target's own draw
equals it is rejection sampling against a one-hot proposal (accepted with probability p(d_j);
on rejection the draw is p conditioned on not d_j = norm(max(0, p - q))), so the output has the
target's distribution, and a seeded request draws the very tokens it draws without speculation.
The engine then rolls the request back to its accepted tokens (scheduler.py).

Prompt logprobs: a chunk with `prompt_logprobs` set also wants the logits of its prompt positions.
Position p's logits predict token p + 1, so positions `start .. min(start + n, P - 1) - 1` (P: prompt
length) give the logprobs of prompt tokens `start + 1 ..`; the last prompt position predicts the first
sampled token and gives none. A prompt chunked over several steps gets its part in each.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from llmserve.config import Config, ConfigError
from llmserve.engine.output import TokenLogprobs
from llmserve.engine.request import Request


@dataclass
class SeqChunk:
    request: Request
    start: int  # position of the chunk's first token (== tokens already in the cache)
    num_tokens: int
    sample: bool  # True when the chunk ends at the request's last token: sample the next one
    # Proposed continuation, verified by the runner (speculative decoding; sampling chunks only).
    draft_token_ids: list[int] = field(default_factory=list)
    # Also return the logprobs of the prompt tokens this chunk's positions predict (see the module doc).
    prompt_logprobs: bool = False
    # Structured output: the tokens its grammar allows at each sampled position (engine/structured.py:
    # rows of int32 words, bit t set when token t may come; one row per sampled position), or a
    # callable returning them, which the runner calls once it has launched the model (the host
    # computes them meanwhile); every other token gets -inf before sampling. None: any token.
    token_bitmask: object = None

    def bitmask(self):
        """token_bitmask, computed now if it was deferred (and kept)."""
        if callable(self.token_bitmask):
            self.token_bitmask = self.token_bitmask()
        return self.token_bitmask

    @property
    def token_ids(self) -> list[int]:
        """The chunk's input tokens: the request's, then the drafts (which count in num_tokens)."""
        k = len(self.draft_token_ids)
        ids = self.request.token_ids_slice(self.start, self.start + self.num_tokens - k)
        return ids + self.draft_token_ids if k else ids

    @property
    def num_sampled_rows(self) -> int:
        """Positions sampled: the last 1 + k of a sampling chunk (k drafts), none otherwise."""
        return 1 + len(self.draft_token_ids) if self.sample else 0

    @property
    def num_prompt_logprobs(self) -> int:
        """Positions of this chunk that give a prompt logprob (0 unless `prompt_logprobs`)."""
        if not self.prompt_logprobs:
            return 0
        return max(0, min(self.start + self.num_tokens, self.request.num_prompt_tokens - 1) - self.start)

    def prompt_logprob_targets(self) -> list[int]:
        """The prompt tokens its positions predict: tokens start + 1 .. start + num_prompt_logprobs."""
        return self.request.prompt_token_ids[self.start + 1 : self.start + 1 + self.num_prompt_logprobs]


@dataclass
class StepBatch:
    chunks: list[SeqChunk]
    # Requests that left since the last step (finished, aborted, preempted):
    # a runner drops per-request state it keeps (sampler seeds, penalty counts)
    # for finished ones; preempted ones come back later with the same req_id.
    finished_req_ids: list[str] = field(default_factory=list)
    # Whether the proposer needs this step's per-request state (mtp: the module's output at each
    # request's last position, for the next step's proposals). False when no step soon will speculate:
    # the runner then skips that work, and the requests have no state until a step keeps it.
    proposer_state: bool = True

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass
class StepResult:
    # One entry per chunk with sample=True, in batch order: its new tokens (one, or with drafts the
    # accepted ones plus the correction or bonus token).
    token_ids: list[list[int]]
    # Per sampled chunk, the target's logprobs of each of its new tokens (None where not asked for).
    logprobs: list[list[TokenLogprobs] | None] | None = None
    model_time: float = 0.0  # seconds inside the model run (for host-overhead accounting)
    sample_time: float = 0.0  # seconds sampling (host samplers; 0 when fused on the device)
    # One entry per chunk with prompt_logprobs=True, in batch order: the logprobs of the prompt tokens
    # start + 1 .. start + num_prompt_logprobs (raw model distribution: log_softmax of the logits).
    prompt_logprobs: list[list[TokenLogprobs]] | None = None


class ModelRunner(abc.ABC):
    """Runs the model over the paged KV cache and samples next tokens.

    `execute` runs a step and returns its tokens. The engine calls `submit` then `result`: a runner
    whose device runs asynchronously (`overlap = True`) returns from `submit` once the step is
    launched, and the engine schedules and launches the next step before asking for this one's
    `result`. The next step's chunks then hold `PENDING` (request.py) for the token each request
    sampled in the step still running: the runner fills those in from its own last output, on the
    device. Steps are launched and resolved in order, at most one ahead.
    """

    block_size: int
    num_kv_blocks: int  # decided at construction (BLOCK_BS or free memory)
    max_model_len: int
    eos_token_ids: frozenset[int]
    vocab_size: int
    overlap: bool = False
    # `submit` returns before the device has run the step (CUDA), so `done` can be False; a step found
    # done before the next is launched is taken in first (LLMEngine.step).
    asynchronous: bool = False
    # Most prompt tokens of one request per step when LONG_PREFILL_TOKENS is 0 (0: the step budget).
    default_long_prefill_tokens: int = 0
    # Tokens a step takes before it stops being bound by reading the weights (speculative decoding's
    # draft-length rule, engine/speculative.py): about peak FLOP/s / memory bandwidth x bytes per weight / 2.
    saturation_tokens: int = 16
    # Most rows of logits one step may sample (speculation caps k by it); 0: no limit.
    max_sampled_rows: int = 0

    @abc.abstractmethod
    def execute(self, batch: StepBatch) -> StepResult: ...

    def submit(self, batch: StepBatch) -> object:
        """Launch a step; returns a handle for `result`. Synchronous runners just run it."""
        return self.execute(batch)

    def result(self, handle: object) -> StepResult:
        return handle  # type: ignore[return-value]

    def done(self, handle: object) -> bool:
        """Whether a submitted step's device work has finished (`result` would not wait)."""
        return True

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release device memory and helper threads."""

    def build_proposer(self, config: Config):
        """The proposer of a model-based SPECULATE_METHOD (draft, mtp) that this runner owns and runs in its
        steps (engine/speculative.py's Proposer); a runner that has none refuses, naming the setting."""
        raise ConfigError(
            f"SPECULATE_METHOD={config.speculate_method} runs on the torch runner only, and this model is "
            f"served by {type(self).__name__} (a Paddle static-graph MODEL_DIR or LLMSERVE_RUNNER=paddle): "
            "use SPECULATE_METHOD=ngram, or serve an HF safetensors model with LLMSERVE_RUNNER=torch"
        )


def split_prompt_logprobs(
    chunks: list[SeqChunk], chosen: list[float], top_ids: list[list[int]], top_vals: list[list[float]]
) -> list[list[TokenLogprobs]]:
    """Per asking chunk (in order), its TokenLogprobs from rows laid out chunk after chunk:
    `chosen[r]` the target's logprob, `top_*[r]` the best ids / logprobs (best first, at least each
    chunk's k of them)."""
    out, r = [], 0
    for c in chunks:
        if not c.prompt_logprobs:
            continue
        k, m = c.request.params.prompt_logprobs or 0, c.num_prompt_logprobs
        out.append([TokenLogprobs(chosen[i], list(zip(top_ids[i][:k], top_vals[i][:k]))) for i in range(r, r + m)])
        r += m
    return out
