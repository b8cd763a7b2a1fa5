"""The engine: request -> scheduler -> runner (model + sampler) -> output.

`step()` runs one batch and returns what each touched request produced. The
engine is single-threaded; the engine core process and the offline `LLM`
drive it in a loop. It knows nothing about HTTP or Triton. With a runner that
launches asynchronously (CUDA), steps overlap: step N+1 is scheduled and
launched before step N's tokens are taken in (see `step`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from llmserve.config import Config
from llmserve.engine.block_manager import BlockManager
from llmserve.engine.output import RequestOutput
from llmserve.engine.output_processor import TextState, check_stop_token
from llmserve.engine.request import FinishReason, Request
from llmserve.engine.runner_contract import ModelRunner, StepBatch, TokenLogprobs
from llmserve.engine.sampling_params import SamplingParams
from llmserve.engine.scheduler import Scheduler, SchedulerOutput
from llmserve.engine.spec_stage import SpecStage
from llmserve.engine.speculative import build_proposer
from llmserve.engine.stats import EngineStats, engine_stats
from llmserve.engine.step_time import StepTimes
from llmserve.engine.step_trace import StepTrace
from llmserve.engine.structured import GrammarMatchers

log = logging.getLogger(__name__)


class DuplicateRequestError(ValueError):
    pass


@dataclass
class _Launch:
    """A step launched on the runner, and what speculation's draft-length rule measures it by."""

    sched: SchedulerOutput
    handle: object
    batch: int  # running + waiting requests when it was scheduled
    k: int  # drafts per request it verifies (0: a plain step)
    t_launch: float
    serial: bool  # run alone: its tokens are taken in before the next step is launched
    # Part of speculation's cost rather than a plain step: a plain step that kept a proposer's
    # per-step state (mtp's module ran in it, for a verification step soon).
    for_spec: bool = False
    tokens: int = 0  # the tokens it computes
    expect: float | None = None  # its expected device seconds (StepTimes)
    trace: str = ""  # its step-trace line (STEP_TRACE), written once it is taken in
    t_sched: float = 0.0
    t_launched: float = 0.0


class LLMEngine:
    def __init__(
        self,
        config: Config,
        runner: ModelRunner,
        tokenizer=None,
        grammar_tokenizer=None,
        default_repetition_penalty: float = 1.0,
    ) -> None:
        self.config = config
        # For requests that leave it unset: the model's own (generation_config.json, model_repetition_penalty).
        self.default_repetition_penalty = default_repetition_penalty
        self.runner = runner
        # Without a tokenizer (the engine core process) outputs carry token ids only: the engine
        # server's front process makes their text and checks stop strings.
        self.tokenizer = tokenizer
        # Structured output: matchers over the model's tokens (the core has the tokenizer for them only).
        self.grammars = GrammarMatchers(grammar_tokenizer or tokenizer, runner.vocab_size, runner.eos_token_ids)
        self.block_manager = BlockManager(runner.num_kv_blocks, runner.block_size, config.enable_prefix_caching)
        self.max_model_len = runner.max_model_len
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.batch_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            block_ratio=config.block_ratio,
            max_model_len=self.max_model_len,
            long_prefill_tokens=config.long_prefill_tokens or runner.default_long_prefill_tokens,
            catch_up=config.prefill_catch_up,
        )
        # Speculative decoding (SPECULATE_METHOD): proposals verified in the next step.
        self.spec = SpecStage(config, runner, build_proposer(config, runner))
        # Overlapped scheduling: step N+1 is scheduled and launched before step N's tokens are
        # taken in, so host work runs while the device computes (runners that launch asynchronously).
        # Not for a step that verifies proposals: they follow the tokens the step before accepted.
        self.overlap = runner.overlap and config.overlap_scheduling
        self.capacity_tokens = runner.num_kv_blocks * runner.block_size
        self.requests: dict[str, Request] = {}
        self._trace = StepTrace(config.step_trace) if config.step_trace else None
        self._text: dict[str, TextState] = {}
        self._pending: list[RequestOutput] = []  # outputs of aborts, sent with the next step
        self._left: list[str] = []  # req_ids that left since the last step (for the runner)
        self._inflight: _Launch | None = None  # launched, output not taken in
        self._times = StepTimes()  # device seconds per step, by size (the step in flight's time left)
        self._steps = self._prompt_tokens = self._gen_tokens = self._preemptions = 0
        self._step_time = self._schedule_time = self._execute_time = 0.0
        self._model_time = self._sample_time = self._output_time = 0.0

    # Speculation's parts, as the stage holds them (tests and the benchmark script reach them here).
    @property
    def proposer(self):
        return self.spec.proposer

    @proposer.setter
    def proposer(self, value) -> None:
        self.spec.proposer = value

    @property
    def draft_length(self):
        return self.spec.rule

    @draft_length.setter
    def draft_length(self, rule) -> None:
        self.spec.rule = rule

    @property
    def spec_stats(self):
        return self.spec.stats

    # ---- requests ------------------------------------------------------
    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Queue a request. Raises ValueError (DuplicateRequestError for a req_id in flight)."""
        params = params or SamplingParams()
        if params.repetition_penalty is None:  # unset: the model's default (a copy: the caller's are its own)
            params = replace(params, repetition_penalty=self.default_repetition_penalty)
        # An aborted request is in flight until step() hands out its final output: were its req_id
        # reused before that, the caller would take that final output for the new request's.
        if req_id in self.requests or any(o.req_id == req_id for o in self._pending):
            raise DuplicateRequestError(f"req_id {req_id!r} is already in flight")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        limit = min(self.max_model_len, self.capacity_tokens)
        if n >= limit:
            raise ValueError(f"the prompt has {n} tokens; this engine serves at most {limit - 1}")
        vocab = self.runner.vocab_size
        for name, ids in (
            ("prompt", prompt_token_ids),
            ("logit_bias", params.logit_bias),
            ("prediction", params.prediction_token_ids),
        ):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is out of vocabulary (the vocabulary is [0, {vocab}))")
        # A request that could outgrow the whole cache could never run: refused, never shortened (the caller's
        # params are not ours to change).
        if n + params.max_tokens > limit:
            raise ValueError(
                f"max_tokens: the prompt's {n} tokens plus max_tokens {params.max_tokens} exceed the {limit} tokens "
                f"this engine serves per request; ask for at most {limit - n}"
            )
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.runner.eos_token_ids
        req = Request(req_id, list(prompt_token_ids), params, frozenset(stop_ids))
        if arrival_time is not None:
            req.arrival_time = arrival_time
        if params.grammar is not None:
            self.grammars.add(req)  # ValueError: it cannot run on this model's tokens
        self.requests[req_id] = req
        self.spec.admit(req)
        self._prompt_tokens += n
        self._text[req_id] = TextState(params, self.tokenizer)  # no text without a tokenizer
        self.scheduler.add(req)
        return req

    def abort(self, req_id: str, reason: str | None = None, notify: bool = True) -> bool:
        """Stop a request and free its blocks now; its final output comes with the next step
        (unless `notify` is False: the caller has ended it already). A step in flight that holds it
        still runs; its token for it is dropped."""
        req = self.requests.get(req_id)
        if req is None:
            return False
        req.finish_reason = FinishReason.ABORT
        out = self._finish(req)
        out.error = reason
        if notify:
            self._pending.append(out)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or self._inflight is not None

    # ---- the step --------------------------------------------------------
    @property
    def step_in_flight(self) -> bool:
        """Whether a launched step's tokens have not been taken in yet (overlapped steps)."""
        return self._inflight is not None

    def step_done(self) -> bool:
        """Whether the device has finished the launched step (True when none is in flight)."""
        return self._inflight is None or self.runner.done(self._inflight.handle)

    def step_left(self) -> float | None:
        """Expected device seconds left in the launched step, less the host time the next one takes
        to launch: how long the host may do other work without the device waiting (0 when none is in
        flight, None when no step of its size has been seen). It began when its predecessor ended."""
        f = self._inflight
        if f is None or f.expect is None:
            return None if f is not None else 0.0
        return self._times.left(f.expect)

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of the step that completed.

        Serial: launch step N and take its tokens in. Overlapped: launch step N+1, then take in
        step N's tokens while N+1 runs (a request that ended in N has its N+1 token dropped).
        A step that verifies proposals is serial: they follow the tokens its predecessor accepted,
        so that one is taken in first; when the draft-length rule gives k = 0 (a busy engine),
        steps overlap as without speculation. So is a step that samples for a grammar: the matcher
        must have taken in the tokens before it to say what may come next.

        A step the device has already finished (the host fell behind: an eager prefill's launch, the
        server's own work) is taken in and returned alone: launching the next one first would hold
        its tokens for that launch, which takes tens of ms when the step prefills many prompts."""
        t0 = time.perf_counter()
        outputs, self._pending = self._pending, []
        if self._finished_in_flight():
            outputs += self._take_in(self._pop_inflight())
        else:
            batch, k = self.spec.plan(len(self.scheduler.running), len(self.scheduler.waiting))
            serial = bool(k) or self.grammars.active()
            if serial and self._inflight is not None:  # its period is part of the switch to a serial step
                self._inflight.for_spec = True
                outputs += self._take_in(self._pop_inflight())
            launched = self._schedule_and_launch(t0, batch, k, serial)
            done, self._inflight = (self._inflight, launched) if self.overlap and not serial else (launched, None)
            if done is not None:
                outputs += self._take_in(done)
            self._trace_step(launched, t0)
        self._step_time += time.perf_counter() - t0
        return outputs

    def _finished_in_flight(self) -> bool:
        f = self._inflight
        return f is not None and self.runner.asynchronous and self.runner.done(f.handle)

    def _pop_inflight(self) -> _Launch:
        f, self._inflight = self._inflight, None
        return f

    def _schedule_and_launch(self, t0: float, batch: int, k: int, serial: bool) -> _Launch | None:
        """Propose, schedule, attach the stages' per-chunk work, and launch the step on the runner."""
        self.spec.propose(self.scheduler.running, k, self._left, self.max_model_len)
        sched = self.scheduler.schedule()
        self.spec.fill(sched.chunks, k)
        self.grammars.attach(sched.chunks)  # masks computed when the runner samples, while the device runs
        self._preemptions += len(sched.preempted)
        trace = self._trace.scheduled(sched, self.scheduler, self.block_manager) if self._trace and sched.chunks else ""
        t_sched = time.perf_counter()
        launched = None
        if sched.chunks:
            left, self._left = self._left, []
            keep = self.spec.keep_state(k, batch)
            handle = self.runner.submit(StepBatch(sched.chunks, finished_req_ids=left, proposer_state=keep))
            launched = _Launch(sched, handle, batch, k, t0, serial or not self.overlap)
            launched.tokens = sched.num_tokens
            launched.expect = self._times.expect(launched.tokens)
            launched.for_spec = self.spec.serves_spec(k, keep, batch)
            launched.trace, launched.t_sched = trace, t_sched
            self._steps += 1
        t1 = time.perf_counter()
        self._schedule_time += t1 - t0
        if launched is not None:
            self._times.launched(t1 - t0)
            launched.t_launched = t1
        return launched

    def _trace_step(self, launched: _Launch | None, t0: float) -> None:
        if launched is not None and launched.trace:
            t2 = time.perf_counter()
            self._trace.write(
                launched.trace, launched.t_sched - t0, launched.t_launched - launched.t_sched, t2 - launched.t_launched
            )

    def _take_in(self, launch: _Launch) -> list[RequestOutput]:
        """Wait for a launched step's tokens and apply them: stops, lengths, text."""
        sched = launch.sched
        t1 = time.perf_counter()
        result = self.runner.result(launch.handle)
        t2 = time.perf_counter()
        self._times.observe(launch.tokens, result.model_time, done_at=t2)
        self._execute_time += t2 - t1
        self._model_time += result.model_time
        self._sample_time += result.sample_time
        now = time.monotonic()
        outputs = []
        if result.prompt_logprobs:
            self._gather_prompt_logprobs(sched, result.prompt_logprobs)
        sampled = [c for c in sched.chunks if c.sample]
        logprobs = result.logprobs or [None] * len(sampled)
        verified = []
        for chunk, tokens, lps in zip(sampled, result.token_ids, logprobs):
            req = chunk.request
            req.num_pending -= 1
            if chunk.draft_token_ids:
                verified.append((len(chunk.draft_token_ids), len(tokens) - 1))
            if req.is_finished:  # ended (stopped, aborted) while this step ran
                continue
            out = self._append(req, tokens, lps, now)
            self.scheduler.rollback(chunk, len(tokens))
            outputs.append(out)
        self.spec.record(verified)
        self.scheduler.update(sched)
        done = time.perf_counter()
        self._output_time += done - t2
        self.spec.measure(launch, result.token_ids, done)
        return outputs

    def _append(self, req: Request, tokens: list[int], lps: list | None, now: float) -> RequestOutput:
        """Take a request's new tokens in order, up to the first that ends it (stop token or string,
        length): nothing after it is emitted or counted."""
        out = RequestOutput(req.req_id, num_prompt_tokens=req.num_prompt_tokens)
        if req.first_token_time is None:
            req.first_token_time = now
            out.ttft = now - req.arrival_time
            if req.params.prompt_logprobs is not None:  # complete: this chunk ended the prompt
                out.prompt_logprobs = req.prompt_logprobs or [None] * req.num_prompt_tokens
                req.prompt_logprobs = None
        text = self._text[req.req_id]
        reason = None
        for token in tokens:
            req.output_token_ids.append(token)
            out.new_token_ids.append(token)
            self._gen_tokens += 1
            reason = check_stop_token(req, token, self.max_model_len)
            if self.grammars.accept(req.req_id, token):  # the structure is complete
                reason = reason or FinishReason.STOP
            reason = text.append([token]) or reason
            if reason is not None:
                break
        if lps is not None:
            out.logprobs = lps[: len(out.new_token_ids)]
        if reason is None:
            out.new_text = text.flush_text(finished=False)
            out.num_output_tokens = len(req.output_token_ids)
            out.num_cached_tokens = req.num_cached_tokens
            return out
        req.finish_reason = reason
        final = self._finish(req)
        final.new_token_ids, final.logprobs, final.ttft = out.new_token_ids, out.logprobs, out.ttft
        final.prompt_logprobs = out.prompt_logprobs
        return final

    @staticmethod
    def _gather_prompt_logprobs(sched: SchedulerOutput, results: list[list[TokenLogprobs]]) -> None:
        """Keep each asking chunk's prompt logprobs on its request until its first token goes out.
        Positions re-run after a preemption keep the value they got first (it is not sent twice)."""
        for chunk, lps in zip((c for c in sched.chunks if c.prompt_logprobs), results):
            req = chunk.request
            if req.is_finished:
                continue
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None] * req.num_prompt_tokens
            got = req.prompt_logprobs
            for p, lp in enumerate(lps, chunk.start + 1):
                if got[p] is None:
                    got[p] = lp

    def _finish(self, req: Request) -> RequestOutput:
        self.grammars.drop(req.req_id)
        self.scheduler.remove(req)
        self.requests.pop(req.req_id, None)
        text = self._text.pop(req.req_id)
        self._left.append(req.req_id)
        return RequestOutput(
            req.req_id,
            new_text=text.flush_text(finished=True),
            finished=True,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            num_cached_tokens=req.num_cached_tokens,
        )

    # ---- introspection -----------------------------------------------------
    def stats(self) -> EngineStats:
        return engine_stats(self)

    def shutdown(self) -> None:
        if self._trace is not None:
            self._trace.close()
        self.runner.shutdown()
