"""Speculative decoding through the engine: n-gram proposals verified by both runners.

Greedy output with speculation (k = 1, 3, 5) must be the output without it, token for token and
text for text, for requests that arrive at staggered steps, share prefixes (prefix-cache hits),
outgrow a small cache (preemption), end on stop strings and on max_tokens, or are aborted while a
verification step runs; every block is free at the end. Proposals come from the requests' own
tokens, so prompts repeat phrases and the tiny random model's greedy loops give matches to accept.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest

from llmserve.config import Config, ConfigError
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.request import Request
from llmserve.engine.sampling_params import SamplingParams
from llmserve.engine.speculative import DraftLength, NgramProposer, SpecStats, ngram_lookup

RUNNERS = ["torch", "paddle"]


@pytest.fixture(scope="module")
def models(tiny_hf_dir, tmp_path_factory):
    out = {"torch": str(tiny_hf_dir)}
    try:
        from llmserve.runners.paddle.export import export_hf  # imports paddle
    except ImportError:  # the GPU box: torch only
        return out
    out["paddle"] = str(export_hf(tiny_hf_dir, tmp_path_factory.mktemp("paddle")))
    return out


def make_engine(models, kind: str, k: int = 0, **overrides) -> LLMEngine:
    from llmserve.engine.tokenizer import load_tokenizer

    if kind not in models:
        pytest.skip(f"needs {kind}")
    kw = dict(block_size=4, max_seq_len=256, batch_size=8, block_bs=8, max_num_batched_tokens=48, device="cpu")
    kw |= dict(overlap_scheduling=True, long_prefill_tokens=16)
    if k:
        kw |= dict(speculate_method="ngram", speculate_max_draft_tokens=k, speculate_adaptive=False)
    kw.update(overrides)
    cfg = Config.from_env(env={}, **kw)
    if kind == "torch":
        from llmserve.runners.torch.runner import TorchRunner

        runner = TorchRunner(models[kind], cfg)
    else:
        from llmserve.engine.sampler import Sampler
        from llmserve.runners.paddle.runner import PaddleRunner

        runner = PaddleRunner(models[kind], cfg, Sampler(0))
    engine = LLMEngine(cfg, runner, load_tokenizer(models[kind]))
    assert (engine.proposer is not None) == bool(k)
    return engine


def workload(seed: int, vocab: int) -> list[tuple[str, list[int], SamplingParams]]:
    """16 greedy requests: repeated phrases, shared prefixes, lengths from 1 to ~70 tokens."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, 12).tolist()
    reqs = []
    for i in range(16):
        phrase = rng.integers(0, vocab, int(rng.integers(2, 6))).tolist()
        ids = (phrase * int(rng.integers(1, 12)))[: int(rng.integers(1, 60))]
        if i % 4 == 0:
            ids = shared + ids  # prefix-cache hits for the later ones
        p = SamplingParams(max_tokens=int(rng.integers(1, 40)), temperature=0.0, ignore_eos=i % 3 == 0)
        reqs.append((f"r{i}", ids, p))
    return reqs


def run(engine: LLMEngine, reqs, arrive_every: int = 2, on_step=None) -> dict[str, tuple]:
    """Requests join a few steps apart; returns req_id -> (tokens, text, finish reason)."""
    got: dict[str, list] = {}
    text: dict[str, str] = {}
    reasons: dict[str, str] = {}
    queue, steps = list(reqs), 0
    while queue or engine.has_unfinished():
        if queue and steps % arrive_every == 0:
            rid, ids, p = queue.pop(0)
            engine.add_request(rid, ids, dataclasses.replace(p))
        if on_step is not None:
            on_step(engine, steps)
        for out in engine.step():
            got.setdefault(out.req_id, []).extend(out.new_token_ids)
            text[out.req_id] = text.get(out.req_id, "") + out.new_text
            if out.finished:
                reasons[out.req_id] = out.finish_reason
        steps += 1
        assert steps < 5000
    assert engine.block_manager.num_used == 0, "blocks left in use"
    assert not engine.requests
    return {r: (got.get(r, []), text.get(r, ""), reasons[r]) for r in reasons}


def with_stop_strings(reqs, plain) -> list:
    """Give some requests a stop string taken from the middle of their plain output's text."""
    out = []
    for i, (rid, ids, p) in enumerate(reqs):
        txt = plain[rid][1]
        if i % 2 and len(txt) > 8:
            a = len(txt) // 2
            p = dataclasses.replace(p, stop=[txt[a : a + 3]], include_stop_str_in_output=bool(i % 4 == 1))
        out.append((rid, ids, p))
    return out


@pytest.mark.parametrize("kind", RUNNERS)
def test_greedy_output_is_the_output_without_speculation(models, kind):
    seed = random.randrange(1 << 30)
    plain_engine = make_engine(models, kind)
    reqs = workload(seed, plain_engine.runner.vocab_size)
    plain = run(plain_engine, reqs)
    reqs = with_stop_strings(reqs, plain)
    plain = run(make_engine(models, kind), reqs)
    assert any(r == "stop" for _, _, r in plain.values())
    for k in (1, 3, 5):
        engine = make_engine(models, kind, k)
        got = run(engine, reqs)
        assert got == plain, f"seed {seed} k={k}"
        st = engine.stats()
        assert st.spec_draft_tokens > 0 and 0 < st.spec_accepted_tokens <= st.spec_draft_tokens, f"seed {seed}"
        assert st.prefix_cache_hits > 0
        # (That accepted drafts save steps is asserted for one request alone below: with 16
        # staggered requests the step count is the last arrival's, whatever the others accept.)
    for rid, _ids, p in reqs:  # lengths applied exactly
        tokens, _, reason = plain[rid]
        assert len(tokens) <= p.max_tokens and (reason != "length" or len(tokens) == p.max_tokens)


def test_overlapped_plain_steps_and_verification_steps_alternate(models):
    """k = 0 steps overlap (PENDING tokens, one step in flight), k > 0 steps take the one in flight
    in first: switching between them every few steps changes no token."""
    seed = random.randrange(1 << 30)
    plain_engine = make_engine(models, "torch")
    reqs = workload(seed, plain_engine.runner.vocab_size)
    plain = run(plain_engine, reqs)
    engine = make_engine(models, "torch", 3)
    ks = iter(random.Random(seed).choices([0, 0, 1, 3], k=5000))
    engine.draft_length.choose = lambda batch, acceptance: next(ks)
    inflight = []
    assert run(engine, reqs, on_step=lambda e, _: inflight.append(e._inflight is not None)) == plain, f"seed {seed}"
    assert any(inflight) and engine.stats().spec_accepted_tokens > 0


@pytest.mark.parametrize("kind", RUNNERS)
def test_preemption_with_speculation(models, kind):
    """A cache too small for all requests: some are preempted, some mid-verification."""
    seed = random.randrange(1 << 30)
    reqs = [
        (rid, ids, dataclasses.replace(p, max_tokens=40, ignore_eos=True))
        for rid, ids, p in workload(seed, make_engine(models, kind, block_bs=1).runner.vocab_size)[:8]
    ]
    small = dict(block_bs=1, batch_size=8)
    plain_engine = make_engine(models, kind, **small)
    plain = run(plain_engine, reqs, arrive_every=1)
    engine = make_engine(models, kind, 3, **small)
    assert run(engine, reqs, arrive_every=1) == plain, f"seed {seed}"
    assert engine.stats().preemptions > 0 and engine.stats().spec_accepted_tokens > 0, f"seed {seed}"


def test_abort_during_a_verification_step_frees_every_block(models):
    engine = make_engine(models, "torch", 4)
    vocab = engine.runner.vocab_size
    rng = np.random.default_rng(random.randrange(1 << 30))
    for i in range(6):
        phrase = rng.integers(0, vocab, 3).tolist()
        engine.add_request(f"a{i}", phrase * 8, SamplingParams(max_tokens=60, min_tokens=60, temperature=0))
    check_abort_while_verifying(engine, [f"a{i}" for i in range(6)], 60)


def check_abort_while_verifying(engine: LLMEngine, req_ids: list[str], max_tokens: int) -> None:
    """Run the engine's requests (`max_tokens` each, all of them) with the first request that
    verifies drafts aborted while that step runs: it ends with an abort and nothing after it, the
    others with exactly max_tokens, and every block is free."""
    submit = engine.runner.submit
    aborted: list[str] = []

    def submit_then_abort(batch):  # the abort arrives while the step that verifies drafts runs
        handle = submit(batch)
        verifying = [c.request.req_id for c in batch.chunks if c.draft_token_ids]
        if verifying and not aborted:
            aborted.append(verifying[0])
            assert engine.abort(verifying[0])
        return handle

    engine.runner.submit = submit_then_abort
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert aborted
    rest = [o for o in outs if o.req_id == aborted[0]]
    assert rest[-1].finish_reason == "abort" and not rest[-1].new_token_ids
    for rid in req_ids:
        n = sum(len(o.new_token_ids) for o in outs if o.req_id == rid)
        assert rid in aborted or n == max_tokens  # exactly max_tokens, nothing past it
    assert engine.block_manager.num_used == 0 and not engine.requests


@pytest.mark.parametrize("kind", RUNNERS)
def test_seeded_requests_same_alone_in_a_batch_and_without_speculation(models, kind):
    seed = random.randrange(1 << 30)
    rng = np.random.default_rng(seed)
    vocab = make_engine(models, kind).runner.vocab_size
    targets = []
    for j in range(3):
        phrase = rng.choice(vocab, 3, replace=False).tolist()
        # Biased towards the phrase so drafts get accepted, penalised by counts that the drafts
        # before each verified row must enter.
        bias = {t: 10.0 for t in phrase}
        p = SamplingParams(max_tokens=40, temperature=0.7, top_p=0.9, seed=seed + j, logit_bias=bias, ignore_eos=True)
        p = dataclasses.replace(p, frequency_penalty=0.3, presence_penalty=0.2, repetition_penalty=1.1)
        targets.append((f"t{j}", phrase * 6, p))
    others = [
        (f"o{i}", rng.integers(0, vocab, int(rng.integers(3, 30))).tolist(), SamplingParams(max_tokens=25))
        for i in range(5)
    ]
    accepted = 0
    for target in targets:
        engine = make_engine(models, kind, 3)  # k = 3 every step: drafts get verified
        alone = run(engine, [target])
        accepted += engine.stats().spec_accepted_tokens
        plain_engine = make_engine(models, kind)
        plain = run(plain_engine, [target])
        assert alone == plain, f"seed {seed}"
        # Alone, every accepted draft token is a step not taken.
        saved = plain_engine.stats().steps - engine.stats().steps
        assert saved == engine.stats().spec_accepted_tokens, f"seed {seed}"
    # In a batch, with the adaptive rule: k changes from step to step (and with the batch), the tokens do not.
    batched = run(make_engine(models, kind, 3, speculate_adaptive=True), [*others[:2], *targets, *others[2:]], 1)
    plain = run(make_engine(models, kind), targets, 1)
    assert {t[0]: batched[t[0]] for t in targets} == plain, f"seed {seed}"
    assert accepted > 0


def _verification_batch(runner, rng, drafts_per_chunk):
    """Requests prefilled up to their last prompt token, and a batch verifying random drafts."""
    from llmserve.engine.runner_contract import SeqChunk, StepBatch

    free = list(range(runner.num_kv_blocks))
    reqs, chunks = [], []
    for i, k in enumerate(drafts_per_chunk):
        n = int(rng.integers(3, 40))
        r = Request(f"v{i}", rng.integers(0, runner.vocab_size, n).tolist(), SamplingParams(temperature=0.0))
        r.block_table = [free.pop() for _ in range(-(-(n + k) // runner.block_size))]
        reqs.append(r)
        chunks.append(SeqChunk(r, n - 1, 1 + k, True, rng.integers(0, runner.vocab_size, k).tolist()))
    runner.execute(StepBatch([SeqChunk(r, 0, r.num_prompt_tokens - 1, False) for r in reqs]))
    return StepBatch(chunks)


def verify_arrays(a: dict, num_tokens: np.ndarray, q: int) -> dict:
    """The reference of cuda_graphs.VerifyPack's layout: a verification step's host arrays (inputs.host_arrays; every chunk a sampling chunk of its last
    token and its drafts, `num_tokens` each) padded to q queries per chunk. A pad repeats its chunk's
    last position (a valid rotary index) with slot -1 (no KV written) and id 0; seq_lens count the
    pads, so each real query sits where its position says and the causal mask hides the pads from it.
    `rows`: the padded rows of the real tokens (all of them sampled), in order."""
    j = np.arange(q)[None, :]
    real = j < num_tokens[:, None]
    first = np.cumsum(num_tokens) - num_tokens
    src = np.where(real, first[:, None] + j, (first + num_tokens - 1)[:, None]).reshape(-1)
    flat = real.reshape(-1)
    return dict(
        ids=np.where(flat, a["ids"][src], 0),
        positions=a["positions"][src],
        slots=np.where(flat, a["slots"][src], -1),
        seq_lens=a["seq_lens"] - num_tokens + q,
        bt=a["bt"],
        rows=np.flatnonzero(flat),
    )


def _same_inputs(graphs, got, want, bs: int, q: int) -> bool:
    """The parts of two copies of the graphs' static buffers that a replay of bucket bs reads (the rest is staging
    bytes no query reads)."""
    import torch

    parts = zip(graphs._views(got), graphs._views(want), (bs * q, bs * q, bs * q, bs, bs))
    return all(torch.equal(a[:n], b[:n]) for a, b, n in parts)


def test_padded_verification_layout_gives_the_eager_logits(models):
    """What a verification CUDA graph computes (verify_arrays' padding to q queries a sequence), run
    eagerly on the CPU over the graphs' static buffers, equals the unpadded eager step's logits."""
    import torch

    from llmserve.runners.torch.cuda_graphs import DecodeGraphs, VerifyPack
    from llmserve.runners.torch.inputs import host_arrays
    from llmserve.runners.torch.runner import TorchRunner

    cfg = Config.from_env(env={}, block_size=4, max_seq_len=256, batch_size=8, block_bs=4)
    runner = TorchRunner(models["torch"], cfg)
    seed = random.randrange(1 << 30)
    rng = np.random.default_rng(seed)
    batch = _verification_batch(runner, rng, [0, 2, 4, 1, 3])
    eager = runner.forward_logits(batch)
    graphs = DecodeGraphs(runner.model, runner.kv_cache, 8, runner.max_blocks_per_seq, 1, max_draft=4)
    a = host_arrays(batch.chunks, runner.block_size)
    v = verify_arrays(a, a["q_lens"], 5)
    with torch.inference_mode():
        bs = graphs.load(v, q=5)
        want = graphs.static.clone()
        padded = graphs._run(bs, 5)[1][torch.from_numpy(v["rows"])]
        # The runner's own packing of the step (no host arrays) fills the same buffers and rows
        assert graphs.verify_q(batch.chunks) == 5
        pack = VerifyPack(batch.chunks, runner.block_size, 5)
        assert graphs.load(pack, q=5) == bs and _same_inputs(graphs, graphs.static, want, bs, 5), f"seed {seed}"
        assert np.array_equal(pack.rows, v["rows"]), f"seed {seed}"
    torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)


def test_which_steps_the_verification_graphs_pack(models):
    """`DecodeGraphs.verify_q`: q for a batch of sampling chunks of last token + drafts (a bucket for them, block
    tables within the graphs'); 0 for a plain decode step, a prefill chunk beside a verifying one, more sequences or
    drafts than the graphs take, a PENDING input; random batches pack as the host arrays' reference lays them out."""
    import torch

    from llmserve.engine.request import PENDING
    from llmserve.engine.runner_contract import SeqChunk
    from llmserve.runners.torch.cuda_graphs import DecodeGraphs, VerifyPack
    from llmserve.runners.torch.inputs import host_arrays
    from llmserve.runners.torch.runner import TorchRunner

    cfg = Config.from_env(env={}, block_size=4, max_seq_len=256, batch_size=8, block_bs=4)
    runner = TorchRunner(models["torch"], cfg)
    graphs = DecodeGraphs(runner.model, runner.kv_cache, 8, runner.max_blocks_per_seq, 1, max_draft=4)
    seed = random.randrange(1 << 30)
    rng = np.random.default_rng(seed)
    for _ in range(20):
        drafts = rng.integers(0, 5, int(rng.integers(1, 9))).tolist()
        batch = _verification_batch(runner, rng, drafts)
        q = 1 + max(drafts)
        assert graphs.verify_q(batch.chunks) == (q if q > 1 else 0), (seed, drafts)
        if q == 1:
            continue
        a = host_arrays(batch.chunks, runner.block_size)
        v = verify_arrays(a, a["q_lens"], q)
        with torch.inference_mode():
            bs = graphs.load(v, q=q)
            want = graphs.static.clone()
            pack = VerifyPack(batch.chunks, runner.block_size, q)
            graphs.static.fill_(-7)
            assert graphs.load(pack, q=q) == bs
        assert _same_inputs(graphs, graphs.static, want, bs, q), (seed, drafts)
        assert np.array_equal(pack.rows, v["rows"]), (seed, drafts)
    chunks = _verification_batch(runner, rng, [2, 1]).chunks
    assert graphs.verify_q(chunks) == 3
    c = chunks[0]
    for bad in (
        [c, SeqChunk(c.request, 0, 3, False)],  # a prefill chunk beside it
        [c] * 9,  # more sequences than the graphs' largest bucket
        [SeqChunk(c.request, c.start, c.num_tokens, True, [PENDING, 1])],
        [SeqChunk(c.request, c.start, 1 + 5, True, [1] * 5)],  # more drafts than the graphs take
    ):
        assert graphs.verify_q(bad) == 0


@pytest.mark.gpu
def test_cuda_graph_verification_matches_eager(models):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from llmserve.runners.torch.runner import TorchRunner

    cfg = Config.from_env(env={}, block_size=4, max_seq_len=256, batch_size=8, block_bs=4)
    cfg = dataclasses.replace(cfg, speculate_method="ngram", speculate_max_draft_tokens=4)
    runner = TorchRunner(models["torch"], cfg)
    assert runner.graphs is not None and runner.graphs.bucket(5, 5) is not None
    rng = np.random.default_rng(random.randrange(1 << 30))
    batch = _verification_batch(runner, rng, [0, 2, 4, 1, 3])
    graphs = runner.graphs
    runner.graphs = None
    eager = runner.forward_logits(batch)
    runner.graphs = graphs
    replayed = runner.forward_logits(batch)  # takes the graph path
    # The same kernels over the same inputs (the bucket's padding rows are computed apart from the real ones), but
    # a verification step of up to 5 tokens a sequence may take a different product kernel for the padded row
    # count (skinny.py's 2-16 rows against the tensor-core GEMM), a different summation order in fp32 before the
    # bf16 roundings: within 2 bf16 ulps (2^-7 relative each) at the logits' largest magnitude. (GPU only:
    # unverified on the CPU, where there are no CUDA graphs.)
    ulp = 2.0**-7 * eager.float().abs().max()
    assert (replayed.float() - eager.float()).abs().max() <= 2 * ulp, (replayed - eager).abs().max()


def test_ngram_lookup():
    t = np.array([5, 1, 2, 3, 9, 1, 2, 3, 7, 4, 1, 2])
    assert ngram_lookup(t, 3, 3) == [3, 7, 4]  # "1 2" last seen at 5..6, followed by 3 7 4
    assert ngram_lookup(t, 1, 2) == [3, 7]  # "2" last seen at 6
    assert ngram_lookup(np.array([1, 2, 3]), 3, 4) == []  # 3 never occurred before
    assert ngram_lookup(np.array([4, 4]), 2, 5) == [4]  # the proposal stops at the end
    rng = np.random.default_rng(random.randrange(1 << 30))
    for _ in range(200):  # against a brute-force search
        t = rng.integers(0, 4, int(rng.integers(2, 40)))
        want = []
        for n in range(min(3, len(t) - 1), 0, -1):
            hits = [i for i in range(len(t) - n) if (t[i : i + n] == t[len(t) - n :]).all()]
            if hits:
                want = t[hits[-1] + n : hits[-1] + n + 4].tolist()
                break
        assert ngram_lookup(t, 3, 4) == want, t


def test_ngram_proposer_follows_a_growing_request():
    prop = NgramProposer(2)
    req = Request("x", [1, 2, 3, 1, 2], SamplingParams())
    prop.propose([req], 2)
    assert req.draft_token_ids == [3, 1]
    req.output_token_ids += [3, 8, 1]
    prop.propose([req], 2)
    assert req.draft_token_ids == [2, 3]  # "1" last seen at 3 (the output's 1 is the suffix)
    prop.drop(["x"])
    assert not prop._tokens


def test_draft_length_rule():
    rule = DraftLength(max_k=5, saturation_tokens=256)  # the modelled costs (nothing measured)
    assert rule.modelled(1, 0.9) == 5  # small batch, good acceptance: the most drafts
    assert rule.modelled(1, 0.05) <= 1
    assert rule.modelled(256, 0.9) == 0  # a saturated batch: plain decoding
    assert rule.modelled(300, 0.99) == 0
    ks = [rule.modelled(b, 0.7) for b in (1, 8, 32, 64, 128, 256)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1] == 0
    assert DraftLength(3, 256, adaptive=False).choose(512, 0.0) == 3
    stats = SpecStats(3)
    for _ in range(100):
        stats.record([(3, 0)])  # always rejected at once
    assert stats.acceptance < 0.05 and stats.drafted_at == [100, 100, 100] and stats.accepted_at == [0, 0, 0]
    for _ in range(100):
        stats.record([(3, 3)])
    assert stats.acceptance > 0.95 and stats.accepted_at == [100, 100, 100]


def test_draft_length_says_when_the_next_step_may_speculate():
    """may_speculate_next (after choose): yes at a new load, while speculation pays, and in the
    WARMUP choices before each exploring one; no while plain steps are best."""
    rule = DraftLength(max_k=3, saturation_tokens=256)
    B = 4
    assert rule.choose(B, 0.6) == 0 and rule.may_speculate_next(B)  # new load: the model may say k > 0
    for _ in range(10):
        rule.observe(B, 0, 0.001, B)
        for k in (1, 2, 3):
            rule.observe(B, k, 0.004, 1.5 * B)  # speculation measured at a loss
    picks, says = [], []
    for _ in range(4 * rule.EXPLORE):
        picks.append(rule.choose(B, 0.6))
        says.append(rule.may_speculate_next(B))
    W, E = rule.WARMUP, rule.EXPLORE
    # Explorations at choice E, then (it confirmed plain steps) twice as long after it.
    assert [i + 1 for i, p in enumerate(picks) if p] == [E, 2 * E + E + 1] and says.count(True) == 2 * W
    for i, said in enumerate(says[:-W]):
        assert said == any(p > 0 for p in picks[i + 1 : i + 1 + W]), i  # an exploring choice is near
    assert rule.may_speculate_next(64)  # another load: not measured yet
    for _ in range(30):
        rule.observe(B, 3, 0.0012, 2.5 * B)  # now verification pays
    assert rule.choose(B, 0.6) == 3 and rule.may_speculate_next(B)
    assert DraftLength(3, 256, adaptive=False).may_speculate_next(B)


def test_an_expensive_exploration_waits_its_cost_out():
    """An exploring verification step that costs 50 plain steps (a draft model catching up) is not
    repeated until plain decoding has run 50 / EXPLORE_SHARE steps' time; meanwhile no step keeps the
    proposer's state for it (may_speculate_next), but the WARMUP ones before the next."""
    rule = DraftLength(max_k=3, saturation_tokens=256)
    B, steps = 4, 4000
    picks, says = [], []
    for _ in range(steps):
        k = rule.choose(B, 0.6)
        picks.append(k)
        says.append(rule.may_speculate_next(B))
        rule.observe(B, k, 0.050 if k else 0.001, 1.5 * B if k else B)
    explored = [i + 1 for i, k in enumerate(picks) if k]
    wait = (0.050 - 0.006) / rule.EXPLORE_SHARE / 0.001  # its cost beyond plain's: 2,200 plain steps
    # The model's k = 1, 2, 3 tried once each at the start, the exploration at choice EXPLORE, the next
    # after its cost is paid off (about 2,400 choices on: not EXPLORE_MAX = 256 later).
    assert explored[:4] == [2, 3, 4, 1 + rule.EXPLORE] and len(explored) == 5, explored  # 1: the yardstick
    assert explored[4] - explored[3] >= wait, explored
    # The state is kept at the new load's first choice and its three first tries, and in the WARMUP
    # choices before each exploration.
    assert says.count(True) == 4 + 2 * rule.WARMUP, [i + 1 for i, x in enumerate(says) if x]


def test_draft_length_follows_measured_rates():
    """The rule runs a plain step first, then the k the model favours, and from then on judges each
    k by its measured tokens per second: verification steps that take 4x a plain step and give 2.5x
    its tokens stop speculation (the model alone would speculate); steps that take 1.2x and give 2.5x
    keep it; a k the model favours is tried before it is judged; every EXPLORE-th choice at a load
    runs the other option."""
    rule = DraftLength(max_k=3, saturation_tokens=256)
    B = 4
    assert rule.choose(B, 0.6) == rule.choose(B, 0.6) == 0  # plain steps until one is measured
    rule.observe(B, 0, 0.001, B)
    assert rule.choose(B, 0.6) == 3  # then the model: a small batch verifies nearly for free
    for _ in range(10):
        rule.observe(B, 0, 0.001, B)
        rule.observe(B, 3, 0.004, 2.5 * B)  # measured: 0.625x the plain rate
    assert rule.choose(B, 0.6) == 2  # k = 2 is not measured yet: the model favours it, so try it
    rule.observe(B, 2, 0.004, 2.2 * B)
    assert rule.choose(B, 0.6) == 1
    rule.observe(B, 1, 0.003, 1.6 * B)
    picks = [rule.choose(B, 0.6) for _ in range(rule.EXPLORE * 3 + 8)]
    # Plain, exploring the model's k twice (at choice EXPLORE, then twice as long after it).
    assert picks.count(0) == len(picks) - 2 and picks.count(3) == 2
    assert rule.rate(64, 0) is None and rule.choose(64, 0.6) == 0  # another load: not measured yet
    for _ in range(30):
        rule.observe(B, 3, 0.0012, 2.5 * B)  # now verification pays
    assert rule.choose(B, 0.6) == 3

    # One-time costs (a kernel compiled for a new shape) do not linger: the first step of a kind is
    # replaced by the second, and a later stall counts at most OUTLIER x the mean.
    rule = DraftLength(max_k=1, saturation_tokens=256)
    rule.observe(B, 0, 0.001, B)
    rule.observe(B, 1, 0.5, 2 * B)  # the first verification step compiled its kernels
    rule.observe(B, 1, 0.0012, 2 * B)
    assert rule.rate(B, 1) == pytest.approx(2 * B / 0.0012)
    rule.observe(B, 1, 1.0, 2 * B)
    assert rule.rate(B, 1) > 2 * B / 0.0012 / 2 > rule.rate(B, 0) / 2  # not 1 / 400 of it


def test_plain_steps_are_measured_once_they_overlap(models):
    """Switching between overlapped plain steps and a serial verification step costs: the plain step
    in flight when it starts ran its device time under the step before (its period is what was left
    of it), and the first plain step after it refills the overlap pipeline (a serial step's cost, on a
    host-bound model twice the overlapped one). The engine measures neither as plain decoding but
    charges both to the verification step, whose switch they are; the plain steps between it measures
    alone."""
    engine = make_engine(models, "torch", 3)
    assert engine.overlap
    ks = itertools.cycle([3, 0, 0, 0])  # a verification step, then three plain ones
    engine.draft_length.choose = lambda batch, acceptance: next(ks)
    observed = []
    measure = engine.draft_length.observe
    engine.draft_length.observe = lambda b, k, s, n: (observed.append((k, n)), measure(b, k, s, n))
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    run(engine, [("a", [5, 9, 13, 2] * 8, params)])
    verify = [n for k, n in observed if k == 3]
    plain = [n for k, n in observed if k == 0]
    assert len(verify) >= 5 and abs(len(plain) - len(verify)) <= 2, observed  # one measured plain step each
    assert set(plain) == {1}
    # Its own 1..4 tokens, the refill's and the step's before it (the first had none before it).
    assert min(verify[1:-1]) >= 3, observed


def test_draft_length_on_a_host_bound_and_a_device_bound_model():
    """The rule in an engine's loop (the first overlapped step after a serial one is charged to that
    serial step): on a host-bound model (host 1, device 1 a step: plain steps overlap at 1, serial
    steps take 2) verification steps that give 1.75x a plain step's tokens for 2.3x its time lose to
    plain decoding, and the rule decodes plainly, also when a verification step after plain ones
    costs more the longer they ran (a draft model catching up: `catch_up` plain steps' worth per
    plain step since the last verification: each exploration costs more than the last, and the time
    until the next grows with it); on a device-bound one (host 0.1) it speculates.
    Throughput within a few percent of the better policy's."""

    def simulate(host: float, device: float, catch_up: float = 0.0, steps: int = 4000) -> tuple[float, float]:
        rule = DraftLength(max_k=2, saturation_tokens=256)
        B, accept = 8, 0.5
        time_used = tokens = 0.0
        prev_k, missed, held = 0, 0, None
        for _ in range(steps):
            k = rule.choose(B, accept)
            if k:  # serial: host and device in turn; 1 + a + a^2 tokens a request
                period = host * 1.2 + device * 1.1 + catch_up * missed * max(host, device)
                got, missed = B * (1 + accept + accept**2), 0
            elif prev_k:  # the pipeline refills: a serial step's cost
                period, got, missed = host + device, B, 1
            else:
                period, got, missed = max(host, device), B, missed + 1
            if held and not k and prev_k:
                rule.observe(B, held[0], held[1] + period, held[2] + got)
            else:
                if held:
                    rule.observe(B, *held)
                if not k:
                    rule.observe(B, k, period, got)
            held = (k, period, got) if k else None
            time_used, tokens, prev_k = time_used + period, tokens + got, k
        best_spec = B * (1 + accept + accept**2) / (host * 1.2 + device * 1.1)
        return tokens / time_used, max(B / max(host, device), best_spec)

    rate, best = simulate(host=1.0, device=1.0)  # speculation: 14 tokens / 2.3 = 6.1; plain: 8
    assert rate >= 0.97 * best
    # An exploration after 256 plain steps costs 51 more; without EXPLORE_SHARE: 0.84x.
    rate, best = simulate(host=1.0, device=1.0, catch_up=0.2)
    assert rate >= 0.95 * best
    rate, best = simulate(host=0.1, device=1.0)  # speculation: 14 / 1.22 = 11.5; plain: 8
    assert rate >= 0.95 * best


def test_speculation_settings_are_checked():
    assert Config.from_env(env={"SPECULATE_METHOD": "ngram"}).speculate_method == "ngram"
    bad = [
        ({"SPECULATE_METHOD": "eagle"}, "SPECULATE_METHOD"),
        ({"SPECULATE_METHOD": "draft"}, "SPECULATE_METHOD=draft"),
        ({"SPECULATE_METHOD": "ngram", "SPECULATE_MAX_DRAFT_TOKEN_NUM": "0"}, "SPECULATE_MAX_DRAFT_TOKEN_NUM"),
        ({"SPECULATE_MAX_NGRAM_SIZE": "9"}, "SPECULATE_MAX_NGRAM_SIZE"),
        ({"SPECULATE_MODEL_PATH": "/x"}, "SPECULATE_MODEL_PATH"),
    ]
    for env, name in bad:
        with pytest.raises(ConfigError, match=name):
            Config.from_env(env=env)


STACK_PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\nclass ", "    for i in range(len(items)):\n"]


def check_stack_serves_speculating(tmp_path, model_dir: str, **env) -> None:
    """The whole stack (Triton + HTTP front end) with `env`: greedy completions of STACK_PROMPTS over
    OpenAI, native HTTP and Triton gRPC equal the offline engine's on `model_dir` without
    speculation, and the metrics show drafts proposed and accepted."""
    import requests

    from llmserve.offline import LLM
    from llmserve.serving.testing import http_stack
    from llmserve.triton.client import TritonStream, collect

    ref_llm = LLM(model_dir, Config.from_env(env={}, block_bs=4, max_seq_len=1024, device="cpu"))
    ref = ref_llm.generate(STACK_PROMPTS, SamplingParams(max_tokens=48, temperature=0.0))
    ref_llm.shutdown()
    env = dict(
        env, MAX_SEQ_LEN=1024, BLOCK_BS=4, SPECULATE_MAX_DRAFT_TOKEN_NUM=env.get("SPECULATE_MAX_DRAFT_TOKEN_NUM", 4)
    )
    env |= dict(SPECULATE_ADAPTIVE=0)  # drafts every step (on this CPU the rule may measure them away)
    with http_stack(tmp_path, **env) as stack:
        stack.wait_ready()
        for prompt, want in zip(STACK_PROMPTS, ref):
            body = {"model": "default", "prompt": prompt, "max_tokens": 48, "temperature": 0}
            oa = requests.post(stack.http_base + "/v1/completions", json=body, timeout=120).json()
            assert oa["choices"][0]["text"] == want.text and oa["usage"]["completion_tokens"] == len(want.token_ids)
            nat = {"text": prompt, "max_dec_len": 48, "top_k": 1}
            got = requests.post(stack.http_base + "/v1/chat/completions", json=nat, timeout=120).json()
            assert got["token_ids"] == want.token_ids and got["result"] == want.text
            msgs = collect(TritonStream(stack.grpc_url).submit(nat | {"req_id": f"g{len(prompt)}"}), timeout=120)
            assert [t for m in msgs for t in m.get("token_ids", [])] == want.token_ids
        m = stack.metrics()
        drafted = m.get("llmserve_spec_decode_draft_tokens_total", 0)
        accepted = m.get("llmserve_spec_decode_accepted_tokens_total", 0)
        assert drafted > 0 and 0 < accepted <= drafted, m


def test_the_whole_stack_serves_with_ngram_speculation(tmp_path, demo_dir):
    """SPECULATE_METHOD=ngram on the trained demo model's static graph (Paddle runner)."""
    check_stack_serves_speculating(tmp_path, demo_dir, SPECULATE_METHOD="ngram")
