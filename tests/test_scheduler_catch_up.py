"""Catch-up (PREFILL_CATCH_UP): a step that left prompt budget unused with nothing waiting lends it
to the next, so requests that arrive just after a step was scheduled do not queue behind it for good.
The scheduler alone, with the engine's bookkeeping of a step's output done by hand."""

import pytest

from llmserve.config import Config
from llmserve.engine.block_manager import BlockManager
from llmserve.engine.request import Request
from llmserve.engine.sampling_params import SamplingParams
from llmserve.engine.scheduler import Scheduler

PROMPT, MAX_TOKENS, BUDGET = 8, 8, 16  # two prompts a step; each request lives MAX_TOKENS steps
CLIENTS = 2 * MAX_TOKENS  # as many requests finish each step as a step's budget prefills


def _run(catch_up: bool, late_step: int | None, steps: int = 60, clients: int = CLIENTS) -> dict[str, int]:
    """Closed-loop clients at matched rates: each finish is answered by a new request before the next
    step is scheduled, except the answers to the finishes of `late_step`, which come one step late
    (after the step after it was scheduled). Returns each request's steps in the queue (arrival to
    first chunk), keyed by its id (r<arrival step>_<n>)."""
    s = Scheduler(BlockManager(256, 4), max_num_seqs=clients, max_num_batched_tokens=BUDGET, catch_up=catch_up)
    added: dict[str, int] = {}
    queued: dict[str, int] = {}
    late: list[Request] = []

    def add(step: int) -> Request:
        req = Request(
            f"r{step}_{len(added)}",
            list(range(len(added) * 10, len(added) * 10 + PROMPT)),
            SamplingParams(max_tokens=MAX_TOKENS),
        )
        added[req.req_id] = step
        s.add(req)
        return req

    for _ in range(clients):
        add(0)
    for step in range(steps):
        out = s.schedule()
        for req in late:  # came while this step was being scheduled: they wait for the next
            s.add(req)
        late = []
        for c in out.chunks:
            if c.request.num_computed_tokens == c.num_tokens:  # its first chunk
                queued[c.request.req_id] = step - added[c.request.req_id]
        s.update(out)
        finished = 0
        for c in out.chunks:
            if c.sample:
                c.request.num_pending -= 1
                c.request.output_token_ids.append(1)
                if c.request.num_generated >= MAX_TOKENS:
                    s.remove(c.request)
                    finished += 1
        for _ in range(finished):
            if step == late_step:
                req = add(step + 1)
                s.waiting.remove(req)
                late.append(req)
            else:
                add(step + 1)
    return queued


def _between(queued: dict[str, int], first: int, last: int = 1 << 30) -> list[int]:
    """Steps in the queue of the requests that arrived at steps first..last."""
    return [q for rid, q in queued.items() if first <= int(rid[1:].split("_")[0]) <= last]


def test_on_time_successors_never_queue():
    for catch_up in (False, True):
        assert set(_between(_run(catch_up, late_step=None), 1)) == {0}


def test_a_late_group_queues_the_requests_of_a_lifetime_without_catch_up():
    """At matched rates the backlog of one group drains only when the step it left without prompts
    comes round again, a request's lifetime later: every request until then waits one step more."""
    queued = _run(catch_up=False, late_step=10)
    assert set(_between(queued, 11, 10 + MAX_TOKENS)) == {1}
    assert set(_between(queued, 12 + MAX_TOKENS)) == {0}


def test_catch_up_drains_a_late_group_in_one_step():
    queued = _run(catch_up=True, late_step=10)
    late = [q for rid, q in queued.items() if rid.startswith("r11_")]
    assert late and set(late) == {1}  # they missed step 11 and joined step 12
    assert set(_between(queued, 12)) == {0}  # and nothing queues after them


def test_lent_budget_is_one_step_at_most_and_one_chunk_stays_capped():
    bm = BlockManager(1024, 4)
    s = Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=BUDGET, catch_up=True, long_prefill_tokens=12)
    for _ in range(3):  # idle steps: nothing lent beyond one budget
        assert s.schedule().num_tokens == 0
    assert s.lent == BUDGET
    for i in range(5):
        s.add(Request(f"p{i}", list(range(i * 100, i * 100 + 40)), SamplingParams(max_tokens=4)))
    out = s.schedule()
    assert [c.num_tokens for c in out.chunks] == [12, 12, 8]  # 2 x BUDGET, each chunk <= 12
    assert s.lent == 0
    out = s.schedule()
    assert out.num_tokens == BUDGET  # back to one budget


def test_nothing_is_lent_while_requests_wait_for_blocks():
    bm = BlockManager(6, 4)  # 24 tokens of KV: the second prompt does not fit
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=BUDGET, catch_up=True)
    s.add(Request("a", list(range(12)), SamplingParams(max_tokens=4)))
    s.add(Request("b", list(range(100, 116)), SamplingParams(max_tokens=4)))
    out = s.schedule()
    assert [c.request.req_id for c in out.chunks] == ["a"] and s.waiting
    assert s.lent == 0


@pytest.mark.parametrize("catch_up, expected", [("1", 2 * 2048 + 50), ("0", 2048 + 50)])
def test_the_largest_step_counts_the_lent_budget(monkeypatch, catch_up, expected):
    monkeypatch.setenv("PREFILL_CATCH_UP", catch_up)
    assert Config.from_env().max_step_tokens == expected
