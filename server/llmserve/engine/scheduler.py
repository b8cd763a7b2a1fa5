"""Continuous batching with chunked prefill, under a prompt-token budget per step.

Each step:
1. Running requests, oldest first, get their next tokens: one for a decoding
   request, the next prompt chunk for one still prefilling. When blocks run
   out, the newest running request is preempted (its blocks freed; it goes
   back to the front of the queue and is recomputed later).
2. Waiting requests are admitted in arrival order while the budget,
   BATCH_SIZE (max running requests) and the blocks allow. Admission may fill
   at most BLOCK_RATIO of the blocks, keeping the rest for running requests
   to grow into (fewer preemptions); an idle engine admits regardless.

The budget (MAX_PREFILL_TOKENS) counts prompt tokens and proposals, not a
decoding request's one token: every running stream advances every step, and a
full batch does not shrink the prefill a step can do. Counted against the
budget, a batch of 256 decodes left 1,792 of 2,048 tokens for prompts, so
prompts were admitted more slowly than the requests they replaced finished
(the prefill queue overloaded, and TTFT grew by hundreds of ms at c=256). A
step holds at most MAX_PREFILL_TOKENS + BATCH_SIZE tokens, and catch-up's saved budget (below).

Catch-up (PREFILL_CATCH_UP = k): prompt budget that steps leave unused while nothing waits, within
RECENT_STEPS steps of a request's end, is saved for later steps, up to k budgets. A finished request's
successor (a served client's next request) travels the server and back first; when it comes just
after a step was scheduled, that step runs light and the request joins a later one. Where prompts
arrive as fast as a step's budget takes them (fixed-length work at full concurrency), that later
step's budget is already full with the requests that came on time, so the late ones would queue one
step behind them until the light steps came round again, a request's lifetime later, and every
request until then would wait a step more. The saved budget takes them beside the on-time ones. It
is saved only after requests ended, for their successors: light steps of a load with nothing ending
(a wave still decoding) save nothing, so a burst that follows them is taken at the budget's rate.
Over any run of steps prompt tokens stay within k budgets of that rate: a step holds at most
(1 + k) x MAX_PREFILL_TOKENS + BATCH_SIZE tokens (Config.max_step_tokens), and one request's chunk
at most LONG_PREFILL_TOKENS.

A scheduled chunk counts as computed at once (`num_computed_tokens` moves when
it is scheduled, and a sampling chunk adds one pending token), so the next
step can be scheduled while this one still runs on the device (overlapped
scheduling). A request whose tokens in flight already reach its length limit
is left out until its step's output ends it.

Speculative decoding: a decoding request with proposed tokens (`Request.draft_token_ids`) gets
them in its chunk, within the token budget and its length limits, with KV slots reserved for them.
After the step, `rollback` moves `num_computed_tokens` back to the accepted tokens and frees the
blocks that held only rejected ones; rejected slots in a kept block are overwritten later, and the
prefix cache (committed after the rollback) never hashes a rejected token. A verification step is
serial (the engine takes the step in flight in first): its proposals follow the tokens that step
accepted.

A request that asks for prompt logprobs skips the prefix cache until they are handed out (with its
first token), and its chunks over prompt positions ask the runner for them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from llmserve.engine.block_manager import BlockManager
from llmserve.engine.request import Request, RequestStatus
from llmserve.engine.runner_contract import SeqChunk

RECENT_STEPS = 8  # catch-up saves budget for this many steps after a request ended


@dataclass
class SchedulerOutput:
    chunks: list[SeqChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        block_ratio: float = 1.0,
        max_model_len: int = 1 << 62,
        long_prefill_tokens: int = 0,
        catch_up: int = 0,
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_ratio = block_ratio
        self.max_model_len = max_model_len
        # Most prompt tokens one request computes in a step (0: the whole budget): keeps steps short
        # beside running streams, and a long prompt from outlasting the engine's hang timeout.
        self.long_prefill_tokens = long_prefill_tokens or max_num_batched_tokens
        self.max_saved = catch_up * max_num_batched_tokens
        self.saved = 0  # prompt budget that steps left unused while nothing waited (catch-up)
        self.since_end = RECENT_STEPS  # steps scheduled since a running request ended
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take a request out (finished or aborted) and free its blocks."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self.since_end = 0
        elif req in self.waiting:
            self.waiting.remove(req)
        self.bm.free(req)
        req.status = RequestStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens + self.saved

        i = 0
        while i < len(self.running):
            req = self.running[i]
            left = req.num_tokens - req.num_computed_tokens
            if req.done_sampling(self.max_model_len) or (left > 1 and budget <= 0):
                i += 1  # its last token is in flight, or a prompt chunk with no budget left
                continue
            drafts = []
            if left == 1:  # decoding: its token is free, its proposals are not
                n = 1
                if req.draft_token_ids:
                    drafts = self._drafts(req, budget)
                    if not self.bm.ensure_slots(req, 1 + len(drafts)):  # no blocks to spare: plain decoding
                        drafts = []
                cost = len(drafts)
            else:
                n = cost = min(left, budget, self.long_prefill_tokens)
            n += len(drafts)
            while not self.bm.ensure_slots(req, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break
            out.chunks.append(self._chunk(req, n, drafts))
            budget -= cost
            i += 1

        # Admit only when nothing was preempted: a preempted request must not be overtaken.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            if req.num_pending:  # preempted with a token in flight: wait until it is known
                break
            # Prompt logprobs need every prompt position's logits: cached positions have none.
            cached = [] if req.needs_prompt_logprobs else self.bm.match_prefix(req)
            computed = len(cached) * self.bm.block_size
            n = min(req.num_tokens - computed, budget, self.long_prefill_tokens)
            new_blocks = self.bm.blocks_for(computed + n) - len(cached)
            if not self.bm.can_allocate(new_blocks, cached):
                break
            whole = self.bm.blocks_for(req.num_tokens) - len(cached)
            if self.running and self.bm.num_used + whole > self.block_ratio * self.bm.num_blocks:
                break
            self.waiting.popleft()
            self.bm.admit(req, cached)
            ok = self.bm.ensure_slots(req, n)
            assert ok
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(self._chunk(req, n))
            budget -= n
        # Saved only while nothing waits (a queue held back by blocks or seats would not use it), and
        # for the successors of requests that just ended.
        self.since_end += 1
        recent = self.since_end <= RECENT_STEPS
        self.saved = min(self.max_saved, max(0, budget)) if recent and not self.waiting else 0
        return out

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """The proposals that fit: the step budget, and room for all of them plus one more token
        within max_tokens and the model's length (nothing past a limit is ever computed)."""
        room = min(budget, req.params.max_tokens - req.num_generated - 1, self.max_model_len - req.num_tokens - 1)
        return req.draft_token_ids[: max(0, room)]

    def rollback(self, chunk: SeqChunk, num_new: int) -> None:
        """After a verification step took `num_new` tokens (accepted drafts + one): forget the
        rejected drafts' KV and give back the blocks that held only them."""
        req = chunk.request
        rejected = len(chunk.draft_token_ids) + 1 - num_new
        if rejected and not req.is_finished:
            req.num_computed_tokens -= rejected
            self.bm.trim(req)

    def update(self, out: SchedulerOutput) -> None:
        """After the step's output was taken in: offer its now full blocks to the prefix cache."""
        for c in out.chunks:
            if not c.request.is_finished:
                self.bm.commit(c.request)

    @staticmethod
    def _chunk(req: Request, n: int, drafts: list[int] = ()) -> SeqChunk:
        start = req.num_computed_tokens
        chunk = SeqChunk(req, start, n, sample=start + n - len(drafts) == req.num_tokens)
        if drafts:
            chunk.draft_token_ids = list(drafts)
        # Positions re-run after a preemption ask again; the engine keeps the first value it got.
        chunk.prompt_logprobs = req.needs_prompt_logprobs and start < req.num_prompt_tokens - 1
        req.num_computed_tokens = start + n
        req.num_pending += chunk.sample
        return chunk

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.bm.free(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
