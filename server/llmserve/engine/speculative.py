"""Speculative decoding, engine side: who proposes tokens, how many, and how well it goes.

Each step, before scheduling, the engine asks the proposer for up to k tokens to follow each
decoding request's last one (`Request.draft_token_ids`); the scheduler puts them in the request's
chunk, the runner verifies them losslessly (runners/base.py) and the engine rolls back the
rejected ones. k comes from `DraftLength`, the measured acceptance from `SpecStats`.

Proposers:
- `ngram` (prompt lookup): the longest suffix of the request's tokens (SPECULATE_MAX_NGRAM_SIZE
  down to 1) that occurred before in its own prompt or output proposes the tokens that followed
  its latest occurrence. No model; host numpy, O(length) per request per step.
"""

from __future__ import annotations

import abc

import numpy as np

from llmserve.config import Config
from llmserve.engine.request import Request


class Proposer(abc.ABC):
    @abc.abstractmethod
    def propose(self, reqs: list[Request], k: int) -> None:
        """Set each request's `draft_token_ids` (at most k tokens; empty: nothing to propose)."""

    def drop(self, req_ids: list[str]) -> None:  # noqa: B027 - optional hook
        """Forget per-request state of requests that left."""


def ngram_lookup(tokens: np.ndarray, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix (n <= max_n)."""
    L = len(tokens)
    if L < 2 or k < 1:
        return []
    # Every earlier position holding the last token: the ends of the candidate 1-gram matches.
    ends = np.flatnonzero(tokens[: L - 1] == tokens[L - 1])
    best = None
    for n in range(1, min(max_n, L - 1) + 1):
        if n > 1:  # of those, the ones whose previous n - 1 tokens match too
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[L - n]]
        if not ends.size:
            break
        best = ends[-1]  # the latest occurrence of the longest suffix found so far
    if best is None:
        return []
    return tokens[best + 1 : best + 1 + k].tolist()


class NgramProposer(Proposer):
    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        # req_id -> (int64 buffer, tokens filled): each token is copied in once, not every step.
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}

    def _array(self, req: Request) -> np.ndarray:
        buf, n = self._tokens.get(req.req_id, (None, 0))
        total = req.num_known_tokens
        if buf is None or n > total:  # new (or a reused req_id)
            buf, n = np.empty(max(64, 2 * total), np.int64), 0
        if total > len(buf):
            buf = np.concatenate([buf[:n], np.empty(total, np.int64)])
        if n < total:
            buf[n:total] = req.token_ids_slice(n, total)
        self._tokens[req.req_id] = (buf, total)
        return buf[:total]

    def propose(self, reqs: list[Request], k: int) -> None:
        for req in reqs:
            req.draft_token_ids = ngram_lookup(self._array(req), self.max_ngram, k) if k else []

    def drop(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            self._tokens.pop(rid, None)


def build_proposer(config: Config) -> Proposer | None:
    if config.speculate_method == "ngram":
        return NgramProposer(config.speculate_max_ngram_size)
    return None  # "none" (draft and mtp are refused by Config.validate)


class SpecStats:
    """Counts of proposed and accepted tokens, overall and per draft position, and a decayed
    estimate of the chance that a draft is accepted given the ones before it were."""

    DECAY = 0.95  # per step: the estimate follows the last ~20 steps

    def __init__(self, max_k: int) -> None:
        self.verified = 0  # request-steps that verified drafts
        self.drafted = 0
        self.accepted = 0
        self.drafted_at = [0] * max_k  # position j (0-based): drafts proposed there
        self.accepted_at = [0] * max_k  # ... and accepted
        # Decayed sums for the acceptance estimate; the prior is one accept in two tries.
        self._acc, self._tried = 1.0, 2.0

    def record(self, results: list[tuple[int, int]]) -> None:
        """One step's (drafts proposed, drafts accepted) per verified request."""
        acc = tried = 0
        self.verified += len(results)
        for k, a in results:
            self.drafted += k
            self.accepted += a
            for j in range(k):
                self.drafted_at[j] += 1
                self.accepted_at[j] += j < a
            acc += a
            tried += min(a + 1, k)  # positions examined: up to and including the first rejection
        self._acc = self.DECAY * self._acc + acc
        self._tried = self.DECAY * self._tried + tried

    @property
    def acceptance(self) -> float:
        """Estimated P(draft j accepted | drafts before it accepted)."""
        return self._acc / self._tried


class DraftLength:
    """k per step: the draft length with the most expected tokens per unit of step time.

    With per-position acceptance a, k drafts yield E(k) = 1 + a + ... + a^k tokens per request.
    A step over t tokens costs max(1, t / S) (S: the runner's `saturation_tokens`, where a step stops
    being bound by reading the weights and becomes bound by compute), plus OVERHEAD per draft
    (attention over more queries, more sampled rows). For B decoding requests choose the k in 0..K
    maximising E(k) / cost(B (k + 1)): at a small batch verification is nearly free and k grows with
    a; once B (k + 1) passes S each extra draft costs its full share, and at B >= S the rule gives 0,
    plain decoding, so a loaded server is never slower."""

    OVERHEAD = 0.02

    def __init__(self, max_k: int, saturation_tokens: int, adaptive: bool = True) -> None:
        self.max_k, self.saturation, self.adaptive = max_k, saturation_tokens, adaptive

    def choose(self, batch: int, acceptance: float) -> int:
        if not self.adaptive:
            return self.max_k
        if batch < 1:
            return 0

        def rate(k: int) -> float:
            gain = sum(acceptance**j for j in range(k + 1))
            return gain / (max(1.0, batch * (k + 1) / self.saturation) * (1 + self.OVERHEAD * k))

        return max(range(self.max_k + 1), key=lambda k: (rate(k), -k))
