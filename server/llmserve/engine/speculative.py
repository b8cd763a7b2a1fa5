"""Speculative decoding, engine side: who proposes tokens, how many, and how well it goes.

Each step, before scheduling, the engine asks the proposer for up to k tokens to follow each
decoding request's last one (`Request.draft_token_ids`); the scheduler puts them in the request's
chunk, the runner verifies them losslessly (engine/runner_contract.py) and the engine rolls back the
rejected ones. k comes from `DraftLength`, the measured acceptance from `SpecStats`.

Proposers:
- `ngram` (prompt lookup): the longest suffix of the request's tokens (SPECULATE_MAX_NGRAM_SIZE
  down to 1) that occurred before in its own prompt or output proposes the tokens that followed
  its latest occurrence. No model; host numpy, O(length) per request per step.
- `draft`: a smaller model with the target's tokenizer (SPECULATE_MODEL_PATH), run k times per
  step with its own paged KV cache; it also hands over its proposal distribution q
  (`Request.draft_probs`), which sampled requests are verified against by rejection sampling.
  Torch runner only (runners/torch/draft.py).
- `mtp`: the checkpoint's multi-token-prediction module, fed by the target's last hidden states and
  chained for k > 1; it drafts into the KV slots the scheduler reserved, so it proposes placeholders
  before scheduling and the real tokens after (`Proposer.fill`). Torch runner only
  (runners/torch/mtp.py).
"""

from __future__ import annotations

import abc

import numpy as np

from llmserve.config import Config
from llmserve.engine.request import Request
from llmserve.engine.runner_contract import ModelRunner, SeqChunk


class Proposer(abc.ABC):
    # Whether proposing needs work in every target step (mtp: the module over the step's positions),
    # which the engine skips while the draft-length rule will not speculate (StepBatch.proposer_state).
    per_step_state = False

    @abc.abstractmethod
    def propose(self, reqs: list[Request], k: int) -> None:
        """Set each request's `draft_token_ids` (at most k tokens; empty: nothing to propose)."""

    def fill(self, chunks: list[SeqChunk]) -> None:  # noqa: B027 - optional hook
        """After scheduling: a proposer that drafts into the KV slots the scheduler reserved (mtp)
        proposed placeholders and writes the chunks' real `draft_token_ids` here."""

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


def build_proposer(config: Config, runner: ModelRunner) -> Proposer | None:
    """The proposer of SPECULATE_METHOD for the engine serving `runner` (None: no speculation).
    Raises ConfigError, naming the setting, for a combination that cannot run."""
    if config.speculate_method == "ngram":
        return NgramProposer(config.speculate_max_ngram_size)
    if config.speculate_method in ("draft", "mtp"):
        return runner.build_proposer(config)  # the runner owns and runs a model-based proposer
    return None  # "none"


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


class StepMeter:
    """What the draft-length rule is told of each decoding step: its tokens over its period.

    Switching between overlapped plain steps and a serial step (a verification step, or a step
    sampling for a grammar) costs, and the switch is charged to the serial step, told to the rule as
    one step with it: the plain steps before it that served it (`for_spec`: the one in flight when it
    started, whose device time ran under the step before so that its period is only what was left
    of it; those that kept a proposer's per-step state for it) and the first plain step after it,
    which refilled the overlap pipeline (a serial step's cost, not what plain steps cost)."""

    def __init__(self) -> None:
        self._held: tuple[int, int, float, int] | None = None  # a serial step's, until the next says
        self._carry = [0.0, 0]  # seconds and tokens of plain steps that belong to the next serial one

    def step(
        self,
        rule: DraftLength,
        batch: int,
        k: int,
        period: float,
        tokens: int,
        serial: bool,
        for_spec: bool,
        refill: bool,
    ) -> None:
        """A decoding step, told to `rule` (prompt chunks are not measured: they would skew the rates)."""
        held, self._held = self._held, None
        if held is not None and refill:
            b, hk, seconds, got = held
            rule.observe(b, hk, seconds + period, got + tokens)
            return
        if held is not None:
            rule.observe(*held)
        if refill:
            return
        if for_spec:
            self._carry[0] += period
            self._carry[1] += tokens
        elif serial:
            (seconds, got), self._carry = self._carry, [0.0, 0]
            self._held = (batch, k, period + seconds, tokens + got)
        else:
            self._carry = [0.0, 0]  # plain decoding went on: what came before served no serial step
            rule.observe(batch, k, period, tokens)

    def other(self, rule: DraftLength) -> None:
        """A step that was not decoding: a serial step held is told as it is."""
        held, self._held = self._held, None
        if held is not None:
            rule.observe(*held)


class DraftLength:
    """k per step: the draft length that gives the most tokens per second at the current load.

    For each load (a power-of-two bucket of running + waiting requests) and each k it has run, it
    keeps decayed means of a decoding step's wall time and of the tokens the step gave (one per
    request at k = 0; accepted drafts + 1 per request that had drafts, 1 per request that had none).
    Their ratio is the k's measured rate. A k not yet run at this load is estimated from the plain
    rate and a model: rate(0) * E(k) / cost(k), with E(k) = 1 + a + ... + a^k for the measured
    per-position acceptance a (SpecStats) and cost(k) = max(1, B (k + 1) / S) (1 + OVERHEAD k), S the
    runner's `saturation_tokens` (where a step stops being bound by reading the weights). The model
    is optimistic, so a k it favours is run and then judged by its measurement, which sees what a
    step really costs (the proposer's work, the serial verification step, kernel shapes) and really
    gives (requests with nothing to propose, the acceptance at this load). A load starts with a
    plain step (its rate is the yardstick), and from time to time a choice runs the other option
    (plain steps while speculating, the model's k while not: `_explore`), so the measurements follow
    the load. An exploring run of plain steps is PLAIN_RUN long: its first step refills the
    overlap pipeline and its last is in flight when the next verification step starts (both are
    charged to verification steps: StepMeter), the others measure what plain steps cost when they
    overlap, which a lone plain step between verification steps never shows (it ran serially: on a
    host-bound model, up to twice the overlapped step). An exploration's cost is paid off before the
    next (EXPLORE_SHARE: `_owed`). So speculation stops where it does not pay: on a saturated GPU,
    on a host-bound model, for requests whose proposals are rarely accepted."""

    OVERHEAD = 0.02
    MARGIN = 0.05
    OUTLIER = 4.0
    EXPLORE = 32  # choices before the first exploration at a load
    EXPLORE_MAX = 256  # the longest wait between two, unless their cost says wait longer:
    EXPLORE_SHARE = 0.02  # at most this share of a load's time goes to steps slower than its best k
    PLAIN_RUN = 3  # plain steps in a row when exploring them while speculating
    WARMUP = 8  # steps that keep the proposer's state before an exploring one (may_speculate_next)
    DECAY = 0.8  # of the means: the last ~5 steps of a kind count most

    def __init__(self, max_k: int, saturation_tokens: int, adaptive: bool = True) -> None:
        self.max_k, self.saturation, self.adaptive = max_k, saturation_tokens, adaptive
        # (batch bucket, k) -> decayed means of (step seconds, tokens the step gave)
        self._seen: dict[tuple[int, int], tuple[float, float]] = {}
        self._count: dict[tuple[int, int], int] = {}  # steps observed per (batch bucket, k)
        self._steps: dict[int, int] = {}  # choices made per batch bucket
        self._last_best: dict[int, int] = {}  # the last choice's best k per batch bucket (before exploring)
        # Per batch bucket: the choice that starts the next exploration, the choices between the last
        # two, and the best k when the last one started.
        self._explore_at: dict[int, int] = {}
        self._interval: dict[int, int] = {}
        self._best_before: dict[int, int] = {}
        # Per batch bucket: seconds of measured steps, and what the steps of other k than the best
        # cost beyond the best's rate (explorations: a draft model catching up, the serial switches).
        self._spent: dict[int, float] = {}
        self._excess: dict[int, float] = {}
        self._mark: dict[int, tuple[float, float]] = {}  # (excess, spent) when the last exploration began

    @staticmethod
    def _bucket(batch: int) -> int:
        return max(1, batch).bit_length()

    def observe(self, batch: int, k: int, seconds: float, tokens: int) -> None:
        """A decoding step of `k` drafts per request (0: plain) took `seconds` of wall time at this
        load and gave `tokens` tokens. The first step of a kind at a load may pay one-time costs
        (kernels compiled for new shapes, first graph replays) that would weigh on its mean for
        hundreds of steps: the second replaces it, and no step counts for more than OUTLIER x the mean."""
        b = self._bucket(batch)
        best = self._last_best.get(b)
        rate = self.rate(batch, best) if best is not None and k != best else None
        if rate:
            self._excess[b] = self._excess.get(b, 0.0) + max(0.0, seconds - tokens / rate)
        self._spent[b] = self._spent.get(b, 0.0) + seconds
        key = (b, k)
        old = self._seen.get(key)
        n = self._count[key] = self._count.get(key, 0) + 1
        d = self.DECAY
        if old is None or n == 2:
            self._seen[key] = (seconds, tokens)
        else:
            seconds = min(seconds, self.OUTLIER * old[0])
            self._seen[key] = (d * old[0] + (1 - d) * seconds, d * old[1] + (1 - d) * tokens)

    def rate(self, batch: int, k: int) -> float | None:
        """Measured tokens per second of steps with k drafts at this load (None: not run yet)."""
        got = self._seen.get((self._bucket(batch), k))
        return got[1] / got[0] if got and got[0] > 0 else None

    def modelled(self, batch: int, acceptance: float) -> int:
        return self._best(lambda k: self._gain(acceptance, k) / self._model_cost(batch, k))

    def choose(self, batch: int, acceptance: float) -> int:
        if not self.adaptive:
            return self.max_k
        if batch < 1:
            return 0
        plain = self.rate(batch, 0)
        if plain is None:
            return 0  # a plain step first: the yardstick

        def rate(k: int) -> float:
            got = self.rate(batch, k)
            if got is not None:
                return got
            return plain * self._gain(acceptance, k) * self._model_cost(batch, 0) / self._model_cost(batch, k)

        best = self._best(rate)
        if best and rate(best) < (1 + self.MARGIN) * plain:
            best = 0  # too close to call: switching between serial and overlapped steps costs too
        b = self._bucket(batch)
        n = self._steps[b] = self._steps.get(b, 0) + 1
        self._last_best[b] = best
        return self._explore(b, n, best, acceptance, batch)

    def _explore(self, b: int, n: int, best: int, acceptance: float, batch: int) -> int:
        """Measure the road not taken: PLAIN_RUN plain steps while speculating, one step of the
        model's k while not. The first comes EXPLORE choices into a load; each that leaves the best k
        as it was doubles the wait for the next (up to EXPLORE_MAX: an exploration that confirms costs
        up to ~5% of a host-bound model's plain rate each time), one that changes it resets the wait."""
        at = self._explore_at.setdefault(b, self.EXPLORE)
        if n < at:
            return best
        if n == at:
            owed = self._owed(b)
            if owed > 0:  # not yet: in about as many choices as the best k's steps take that long
                step = self._seen.get((b, best), (0.0, 0.0))[0]
                self._explore_at[b] = n + 1 + (int(owed / step) if step > 0 else self.EXPLORE)
                return best
            self._mark[b] = (self._excess.get(b, 0.0), self._spent.get(b, 0.0))
            self._best_before[b] = best
        before = self._best_before[b]
        if n < at + (self.PLAIN_RUN if before else 1):  # exploring
            return 0 if before else self.modelled(batch, acceptance)
        # The first choice after it: how long until the next.
        wait = self._interval.get(b, self.EXPLORE)
        wait = min(2 * wait, self.EXPLORE_MAX) if best == before else self.EXPLORE
        self._interval[b], self._explore_at[b] = wait, n + wait
        return best

    def _owed(self, b: int) -> float:
        """Seconds of measured steps still to run before the next exploration at this load: the last
        exploration (and any choice since that ran slower than the best) may cost at most
        EXPLORE_SHARE of the time from its start to the next. A draft model that catches up over
        every token since it last ran costs more the longer plain decoding went on."""
        last_excess, last_spent = self._mark.get(b, (0.0, 0.0))
        return (self._excess.get(b, 0.0) - last_excess) / self.EXPLORE_SHARE - (self._spent.get(b, 0.0) - last_spent)

    def may_speculate_next(self, batch: int) -> bool:
        """Whether a choice soon at this load may give k > 0 (called after `choose`): a load whose
        best k is above 0, or an exploring choice within the next WARMUP. When not, a step need not
        keep the proposer's per-step state (mtp: the module's K/V at its positions, so the WARMUP
        steps before an exploring one refill the recent ones). Plain steps explored while speculating
        keep none either (but the last): they measure plain decoding as it is, and the engine counts
        a plain step that kept the state as part of speculation's cost, once plain decoding has a
        rate at this load. A wrong guess costs one step's proposals their state (weaker proposals)."""
        if not self.adaptive:
            return True
        b = self._bucket(batch)
        if self.rate(batch, 0) is None or self._last_best.get(b) is None:
            return True  # a new load: the model may say k > 0 next
        n, at = self._steps[b], self._explore_at.get(b, self.EXPLORE)
        if self._best_before.get(b) and at <= n < at + self.PLAIN_RUN - 1:
            return False  # plain steps explored while speculating measure plain decoding as it is
        if self._last_best[b] > 0:
            return True
        step = self._seen.get((b, 0), (0.0, 0.0))[0]
        return 0 < at - n <= self.WARMUP and self._owed(b) <= (at - n) * step  # paid off by then

    @staticmethod
    def _gain(acceptance: float, k: int) -> float:
        return sum(acceptance**j for j in range(k + 1))

    def _model_cost(self, batch: int, k: int) -> float:
        return max(1.0, batch * (k + 1) / self.saturation) * (1 + self.OVERHEAD * k)

    def _best(self, rate) -> int:
        return max(range(self.max_k + 1), key=lambda k: (rate(k), -k))
