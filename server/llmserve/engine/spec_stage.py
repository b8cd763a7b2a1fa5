"""Speculative decoding as a stage of the engine step (LLMEngine.step calls it at fixed points).

Before scheduling: how many drafts per request this step verifies (`plan`; the draft-length rule of
speculative.py) and the proposals themselves (`propose`). After scheduling: the proposer's per-step
state for the scheduled chunks (`fill`), and whether the runner keeps it (`keep_state`). After a step
is taken in: acceptance counts (`record`) and the step's cost for the rule (`measure`). Without a
proposer every call is a no-op and `plan` gives k = 0, except for requests that carry a prediction
(OpenAI's predicted outputs, engine/prediction.py): they are given its tokens as proposals, k = the most
drafts (SPECULATE_MAX_DRAFT_TOKEN_NUM) while any such request runs. With a configured proposer that keeps
per-request state of its own (draft, mtp), that proposer's drafts are used and the prediction is not.
"""

from __future__ import annotations

from llmserve.config import Config
from llmserve.engine.prediction import PredictionProposer
from llmserve.engine.request import Request
from llmserve.engine.runner_contract import ModelRunner, SeqChunk
from llmserve.engine.speculative import DraftLength, Proposer, SpecStats, StepMeter


class SpecStage:
    def __init__(self, config: Config, runner: ModelRunner, proposer: Proposer | None) -> None:
        self.proposer = proposer
        k = config.speculate_max_draft_tokens
        self.max_k = k
        # Predicted outputs: their proposer, and the requests in flight that carry one.
        self.predictions = PredictionProposer() if proposer is None or not proposer.per_step_state else None
        self._predicted: set[str] = set()
        self.stats = SpecStats(k)
        self.rule = DraftLength(k, runner.saturation_tokens, config.speculate_adaptive)
        self.max_rows = runner.max_sampled_rows  # the sampler's scratch (and the KV sizing) per step
        self._meter = StepMeter()  # what the draft-length rule is told of each step
        self._proposed = False  # the last step's requests may carry proposals (to clear)
        self._last_done = 0.0  # when the last step's output was taken in

    @property
    def on(self) -> bool:
        return self.proposer is not None

    def admit(self, req: Request) -> None:
        """A request enters the engine: one with a prediction is proposed its tokens."""
        if self.predictions is not None and req.params.prediction_token_ids:
            self._predicted.add(req.req_id)

    def plan(self, running: int, waiting: int) -> tuple[int, int]:
        """(load, k): the requests running and waiting (their prompts come first, and a verification
        step would hold them up), and the drafts per request for the next step: the rule's k for that
        load, capped so that the step samples at most the rows the runner has room for."""
        if not self.on and not self._predicted:
            return 0, 0
        batch = running + waiting
        k = self.rule.choose(batch, self.stats.acceptance) if self.on else self.max_k
        if self.max_rows and batch:
            k = max(0, min(k, self.max_rows // batch - 1))
        return batch, k

    def propose(self, running: list[Request], k: int, left: list[str], max_model_len: int) -> None:
        """Proposals (k each) for the decoding requests; stale ones are cleared, and the proposer
        forgets the requests that left."""
        if left and self.on:
            self.proposer.drop(left)
        if left and self._predicted:
            self.predictions.drop(left)
            self._predicted.difference_update(left)
        if not k and not self._proposed:  # a plain step after plain steps: nothing to clear or propose
            return
        self._proposed = bool(k)
        decoding = []
        for req in running:
            req.draft_token_ids, req.draft_probs = [], None
            if req.num_tokens - req.num_computed_tokens == 1 and not req.done_sampling(max_model_len):
                decoding.append(req)
        if k and decoding and self.on:
            self.proposer.propose(decoding, k)
        if k and decoding and self._predicted:
            self.predictions.propose([r for r in decoding if r.req_id in self._predicted], k)

    def fill(self, chunks: list[SeqChunk], k: int) -> None:
        if k and self.on:
            self.proposer.fill(chunks)

    def keep_state(self, k: int, batch: int) -> bool:
        """Whether the runner keeps the proposer's per-step state (mtp) in this step: only while a step
        soon may speculate."""
        p = self.proposer
        return p is None or k > 0 or not p.per_step_state or self.rule.may_speculate_next(batch)

    def serves_spec(self, k: int, keep: bool, batch: int) -> bool:
        """A plain step that kept the proposer's state served speculation (StepMeter), unless it is the
        first at this load: plain decoding's yardstick."""
        p = self.proposer
        served = p is not None and not k and keep and p.per_step_state
        return served and self.rule.rate(batch, 0) is not None

    def record(self, verified: list[tuple[int, int]]) -> None:
        if verified:
            self.stats.record(verified)

    def measure(self, launch, token_ids: list[list[int]], done: float) -> None:
        """Tell the rule what the step taken in at `done` cost (`launch`: the engine's _Launch; `token_ids`:
        its result's tokens)."""
        if self.on:
            if all(c.num_tokens == c.num_sampled_rows for c in launch.sched.chunks):  # decoding
                # Launched after its predecessor was taken in (the first after a serial step), it ran
                # with nothing to overlap: a refill.
                refill = not launch.serial and launch.t_launch > self._last_done
                period = done - (self._last_done or launch.t_launch)
                tokens = sum(len(t) for t in token_ids)
                self._meter.step(
                    self.rule, launch.batch, launch.k, period, tokens, launch.serial, launch.for_spec, refill
                )
            else:
                self._meter.other(self.rule)
        self._last_done = done
