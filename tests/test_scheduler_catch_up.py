"""Catch-up (PREFILL_CATCH_UP = k): prompt budget that steps leave unused while nothing waits is saved
for the next steps (up to k budgets), so requests that arrive just after a step was scheduled do not
queue behind the requests that come on time. The scheduler alone, with the engine's bookkeeping of a
step's output done by hand."""

import pytest

from llmserve.config import Config
from llmserve.engine.block_manager import BlockManager
from llmserve.engine.request import Request
from llmserve.engine.sampling_params import SamplingParams
from llmserve.engine.scheduler import RECENT_STEPS, Scheduler

PROMPT, MAX_TOKENS, BUDGET = 8, 8, 16  # two prompts a step; each request lives MAX_TOKENS steps
CLIENTS = 2 * MAX_TOKENS  # as many requests finish each step as a step's budget prefills


def _run(catch_up: int, late: dict[int, int], steps: int = 60, clients: int = CLIENTS) -> dict[str, int]:
    """Closed-loop clients at matched rates: each finish is answered by a new request before the next
    step is scheduled, except the answers to the finishes of step f in `late`, which come after step
    f + late[f] was scheduled. Returns each request's steps in the queue (from the first step it
    could join to the step of its first chunk), keyed by its id (r<first step it could join>_<n>)."""
    s = Scheduler(BlockManager(256, 4), max_num_seqs=clients, max_num_batched_tokens=BUDGET, catch_up=catch_up)
    added: dict[str, int] = {}
    queued: dict[str, int] = {}
    due: dict[int, int] = {}  # step -> requests that arrive just after it was scheduled

    def add(step: int) -> None:
        n = len(added)
        req = Request(f"r{step}_{n}", list(range(n * 10, n * 10 + PROMPT)), SamplingParams(max_tokens=MAX_TOKENS))
        added[req.req_id] = step
        s.add(req)

    for _ in range(clients):
        add(0)
    for step in range(steps):
        out = s.schedule()
        for _ in range(due.pop(step, 0)):
            add(step + 1)
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
        if step in late:
            due[step + late[step]] = due.get(step + late[step], 0) + finished
        else:
            for _ in range(finished):
                add(step + 1)
    return queued


def _between(queued: dict[str, int], first: int, last: int = 1 << 30) -> list[int]:
    """Steps in the queue of the requests that arrived at steps first..last."""
    return [q for rid, q in queued.items() if first <= int(rid[1:].split("_")[0]) <= last]


def test_on_time_successors_never_queue():
    for catch_up in (0, 1, 2):
        assert set(_between(_run(catch_up, late={}), 1)) == {0}


def test_a_late_group_queues_the_requests_of_a_lifetime_without_catch_up():
    """At matched rates the backlog of one group drains only when the step it left without prompts
    comes round again, a request's lifetime later: every request until then waits one step more."""
    queued = _run(catch_up=0, late={10: 1})  # step 11 runs without prompts; they come for step 12
    assert set(_between(queued, 13, 10 + MAX_TOKENS)) == {1}
    assert set(_between(queued, 12 + MAX_TOKENS)) == {0}


def test_catch_up_drains_a_late_group_in_one_step():
    queued = _run(catch_up=1, late={10: 1})
    assert set(_between(queued, 12)) == {0}  # step 12 takes them beside the on-time group


def test_groups_that_pile_up_need_the_budget_of_as_many_steps():
    """Two late groups (the first two steps late) come beside an on-time one: three groups for one
    step. One saved budget leaves one group queued for a lifetime; two take them all."""
    late = {10: 2, 11: 1}  # steps 11 and 12 run without prompts; six requests come for step 13
    assert set(_between(_run(catch_up=1, late=late), 14, 10 + MAX_TOKENS)) == {1}
    assert set(_between(_run(catch_up=2, late=late), 13)) == {0}


def _ended(s: Scheduler) -> None:
    """A request runs and ends: catch-up may save budget for its successor."""
    req = Request("x", [1, 2, 3, 4], SamplingParams(max_tokens=1))
    s.add(req)
    s.schedule()
    s.remove(req)


def test_saved_budget_is_capped_and_one_chunk_stays_capped():
    bm = BlockManager(1024, 4)
    s = Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=BUDGET, catch_up=2, long_prefill_tokens=12)
    _ended(s)
    for _ in range(4):  # light steps after it: at most two budgets are saved
        assert s.schedule().num_tokens == 0
    assert s.saved == 2 * BUDGET
    for i in range(5):
        s.add(Request(f"p{i}", list(range(i * 100, i * 100 + 40)), SamplingParams(max_tokens=4)))
    out = s.schedule()
    assert [c.num_tokens for c in out.chunks] == [12, 12, 12, 12]  # 3 x BUDGET, each chunk <= 12
    assert s.saved == 0
    assert s.schedule().num_tokens == BUDGET  # back to one budget


def test_budget_is_saved_only_for_the_successors_of_requests_that_just_ended():
    """Light steps with nothing ending (a wave still decoding) save nothing, so a burst after them
    is taken at the budget's rate; what was saved after an end is gone RECENT_STEPS steps later."""
    s = Scheduler(BlockManager(1024, 4), max_num_seqs=16, max_num_batched_tokens=BUDGET, catch_up=2)
    for _ in range(4):
        s.schedule()
    assert s.saved == 0
    _ended(s)
    s.schedule()
    s.schedule()
    assert s.saved == 2 * BUDGET  # a budget a light step, up to two
    for _ in range(RECENT_STEPS - 1):
        s.schedule()
    assert s.saved == 0


def test_nothing_is_saved_while_requests_wait_for_blocks():
    bm = BlockManager(6, 4)  # 24 tokens of KV: the second prompt does not fit
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=BUDGET, catch_up=2)
    s.add(Request("a", list(range(12)), SamplingParams(max_tokens=4)))
    s.add(Request("b", list(range(100, 116)), SamplingParams(max_tokens=4)))
    out = s.schedule()
    assert [c.request.req_id for c in out.chunks] == ["a"] and s.waiting
    assert s.saved == 0


@pytest.mark.parametrize("catch_up, expected", [("2", 3 * 2048 + 50), ("0", 2048 + 50)])
def test_the_largest_step_counts_the_saved_budget(monkeypatch, catch_up, expected):
    monkeypatch.setenv("PREFILL_CATCH_UP", catch_up)
    assert Config.from_env().max_step_tokens == expected


def test_a_negative_catch_up_is_refused(monkeypatch):
    monkeypatch.setenv("PREFILL_CATCH_UP", "-1")
    with pytest.raises(Exception, match="PREFILL_CATCH_UP"):
        Config.from_env().validate()
