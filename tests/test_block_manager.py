"""Block manager and scheduler bookkeeping, on their own (no model)."""

import random

from llmserve.engine.block_manager import BlockManager
from llmserve.engine.request import Request, RequestStatus
from llmserve.engine.sampling_params import SamplingParams
from llmserve.engine.scheduler import Scheduler


def _req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def test_alloc_free_and_refcounts():
    bm = BlockManager(8, 4)
    a = _req("a", range(10))
    bm.admit(a, bm.match_prefix(a))
    assert bm.ensure_slots(a, 10)
    assert len(a.block_table) == 3 and bm.num_free == 5
    a.num_computed_tokens = 10
    bm.commit(a)
    assert len(a.block_hashes) == 2  # two full blocks hashed, the partial one not
    bm.free(a)
    assert bm.num_free == 8 and all(b.ref_count == 0 for b in bm.blocks)


def test_prefix_blocks_are_shared_and_survive_free():
    bm = BlockManager(16, 4)
    prefix = [random.randrange(1000) for _ in range(9)]
    a = _req("a", prefix + [1, 2, 3])
    bm.admit(a, bm.match_prefix(a))
    bm.ensure_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    bm.commit(a)
    b = _req("b", prefix + [7, 8])
    hit = bm.match_prefix(b)
    assert hit == a.block_table[:2]  # 8 tokens of the 9-token prefix are in full blocks
    bm.admit(b, hit)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert [bm.blocks[x].ref_count for x in hit] == [2, 2]
    bm.free(a)
    assert [bm.blocks[x].ref_count for x in hit] == [1, 1]
    bm.free(b)
    # Freed but still cached: a third request finds them.
    c = _req("c", prefix + [5])
    assert bm.match_prefix(c) == hit


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(8, 4)
    a = _req("a", range(8))
    bm.admit(a, [])
    bm.ensure_slots(a, 8)
    a.num_computed_tokens = 8
    bm.commit(a)
    same = _req("b", range(8))
    assert len(bm.match_prefix(same)) == 1  # block 2 holds the last token: recomputed


def test_eviction_drops_stale_hashes():
    bm = BlockManager(2, 4)
    a = _req("a", range(8))
    bm.admit(a, [])
    bm.ensure_slots(a, 8)
    a.num_computed_tokens = 8
    bm.commit(a)
    bm.free(a)
    b = _req("b", range(100, 108))
    bm.admit(b, bm.match_prefix(b))
    assert bm.ensure_slots(b, 8)  # reuses both blocks, evicting a's content
    assert bm.match_prefix(_req("c", list(range(8)) + [9])) == []


def _queued(num_blocks: int, budget: int, reqs: list[Request]) -> tuple[BlockManager, Scheduler]:
    """A scheduler (blocks of 4 tokens, up to 8 running) with `reqs` added."""
    bm = BlockManager(num_blocks, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=budget)
    for r in reqs:
        s.add(r)
    return bm, s


def test_scheduler_preempts_newest_and_respects_budget():
    reqs = [_req(f"r{i}", range(i * 10, i * 10 + 7)) for i in range(3)]
    bm, s = _queued(6, 16, reqs)
    out = s.schedule()
    # 7 + 7 tokens, and r2 gets a chunk of the 2 left in the budget (chunked prefill)
    assert [(c.request.req_id, c.num_tokens, c.sample) for c in out.chunks] == [
        ("r0", 7, True),
        ("r1", 7, True),
        ("r2", 2, False),
    ]
    s.update(out)
    for c in out.chunks:
        if c.sample:
            c.request.output_token_ids.append(1)
    # Now grow r0 and r1 until blocks run out: the newest running request is preempted.
    preempted = []
    for _ in range(6):
        out = s.schedule()
        preempted += [r.req_id for r in out.preempted]
        s.update(out)
        for c in out.chunks:
            if c.sample:
                c.request.output_token_ids.append(1)
    assert preempted and preempted[0] != "r0"
    assert all(r.status in (RequestStatus.RUNNING, RequestStatus.WAITING) for r in reqs)
    assert sum(len(r.block_table) for r in reqs) == bm.num_used


def test_decodes_do_not_take_the_prompt_budget():
    """A full batch of decoding requests leaves the whole MAX_PREFILL_TOKENS to waiting prompts
    (counted against it, 4 decodes would leave 12 of 16 and the prompt would get a chunk of 12);
    a chunked prefill that finds the budget spent skips the step while the decodes after it run."""
    _, s = _queued(64, 16, [_req(f"d{i}", range(i * 10, i * 10 + 4)) for i in range(4)])
    out = s.schedule()
    assert [c.num_tokens for c in out.chunks] == [4, 4, 4, 4]  # each samples a token (pending)
    long_a, long_b = _req("a", range(100, 140)), _req("b", range(200, 216))
    s.add(long_a)
    s.add(long_b)
    out = s.schedule()
    got = [(c.request.req_id, c.num_tokens) for c in out.chunks]
    assert got == [("d0", 1), ("d1", 1), ("d2", 1), ("d3", 1), ("a", 16)]
    assert out.num_tokens == 16 + 4  # at most Config.max_step_tokens
    # a (running, 24 prompt tokens left) takes the whole budget; b waits; the decodes still run.
    out = s.schedule()
    assert [(c.request.req_id, c.num_tokens) for c in out.chunks] == [
        ("d0", 1),
        ("d1", 1),
        ("d2", 1),
        ("d3", 1),
        ("a", 16),
    ]
    assert long_b.status == RequestStatus.WAITING


def test_block_ratio_limits_admission():
    bm = BlockManager(10, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=1000, block_ratio=0.5)
    a, b = _req("a", range(16)), _req("b", range(100, 116))
    s.add(a)
    s.add(b)
    out = s.schedule()
    # a takes 4 blocks; b would bring it to 8 > 0.5 * 10: b waits.
    assert [c.request.req_id for c in out.chunks] == ["a"]
