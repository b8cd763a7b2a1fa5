"""Overlapped scheduling (step N+1 launched before step N's tokens are taken in) against the serial loop.

The torch runner launches the same way on CPU as on CUDA, so these run the real overlap logic: PENDING
inputs filled from the last step's tokens, penalty counts kept on the device, lengths and stops applied
to tokens that arrive one step late, and blocks of requests that end while a step is in flight.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from llmserve.config import Config
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.sampling_params import SamplingParams
from llmserve.serving.testing import record
from tests.test_torch_runner import tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_checkpoint(path, "llama", seed=random.randrange(1 << 16))
    return path


def make_engine(path, overlap: bool, **overrides) -> LLMEngine:
    from llmserve.runners.torch.runner import TorchRunner

    kw = dict(block_size=4, max_seq_len=256, batch_size=8, block_bs=4, max_num_batched_tokens=40)
    kw.update(overrides)
    cfg = Config(overlap_scheduling=overlap, **kw)
    engine = LLMEngine(cfg, TorchRunner(str(path), cfg))
    assert engine.overlap == overlap
    return engine


def workload(seed: int) -> list[tuple[str, list[int], SamplingParams]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(12):
        p = SamplingParams(
            max_tokens=int(rng.integers(3, 30)),
            temperature=[0.0, 0.8, 1.3][i % 3],
            top_p=[1.0, 0.9][i % 2],
            top_k=[0, 20][(i // 2) % 2],
            seed=int(rng.integers(0, 1 << 30)) if i % 3 else None,
            repetition_penalty=[1.0, 1.3][(i // 3) % 2],
            frequency_penalty=[0.0, 0.5][(i // 4) % 2],
            stop_token_ids=[int(rng.integers(0, 256))] if i % 4 == 1 else [],
            min_tokens=int(rng.integers(0, 3)),
        )
        out.append((f"r{i}", rng.integers(0, 256, size=int(rng.integers(1, 60))).tolist(), p))
    return out


def run(engine: LLMEngine, reqs, arrive_every: int = 2) -> dict[str, tuple[list[int], str]]:
    """Requests join a few steps apart; returns req_id -> (tokens, finish reason)."""
    got: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    queue = list(reqs)
    steps = 0
    while queue or engine.has_unfinished():
        if queue and steps % arrive_every == 0:
            rid, ids, p = queue.pop(0)
            engine.add_request(rid, ids, dataclasses.replace(p))
        for out in engine.step():
            got.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.req_id] = out.finish_reason
        steps += 1
        assert steps < 5000
    assert engine.block_manager.num_used == 0
    return {r: (got.get(r, []), reasons[r]) for r in reasons}


def test_overlapped_steps_give_the_serial_tokens(checkpoint):
    seed = random.randrange(1 << 20)
    reqs = workload(seed)
    serial = run(make_engine(checkpoint, overlap=False), reqs)
    overlapped = run(make_engine(checkpoint, overlap=True), reqs)
    assert overlapped == serial, f"seed {seed}"
    for rid, _ids, p in reqs:  # lengths and stop ids were applied exactly
        tokens, reason = serial[rid]
        assert len(tokens) <= p.max_tokens
        if reason == "length":
            assert len(tokens) == p.max_tokens
        for t in tokens[:-1]:
            assert t not in p.stop_token_ids or len(tokens) - 1 < p.min_tokens


def test_overlap_with_preemption_gives_the_serial_tokens(checkpoint):
    """A cache too small for all requests at once: requests are preempted (some with a token in flight)."""
    reqs = [(r, ids, dataclasses.replace(p, max_tokens=40, min_tokens=40)) for r, ids, p in workload(7)[:8]]
    small = dict(block_bs=1, batch_size=8)
    serial_engine = make_engine(checkpoint, overlap=False, **small)
    serial = run(serial_engine, reqs, arrive_every=1)
    overlapped_engine = make_engine(checkpoint, overlap=True, **small)
    overlapped = run(overlapped_engine, reqs, arrive_every=1)
    assert overlapped == serial
    assert all(len(t) == 40 for t, _ in overlapped.values())
    assert serial_engine.stats().preemptions > 0 and overlapped_engine.stats().preemptions > 0


def as_if_asynchronous(engine: LLMEngine, done_share: float, seed: int) -> list[int]:
    """The CPU runner run as a CUDA one whose launched step is found done `done_share` of the time;
    returns a list that counts the launches."""
    runner, rng, launches = engine.runner, random.Random(seed), []
    submit = runner.submit
    runner.asynchronous = True
    runner.done = lambda handle: rng.random() < done_share
    runner.submit = lambda step: launches.append(1) or submit(step)
    return launches


def test_a_step_found_done_is_taken_in_before_the_next_launch(checkpoint):
    """A launched step the device has finished is returned at once, without launching the next (whose
    launch could hold its tokens for tens of ms); the tokens stay the serial loop's."""
    seed = random.randrange(1 << 20)
    reqs = workload(seed)
    serial = run(make_engine(checkpoint, overlap=False), reqs)
    mixed = make_engine(checkpoint, overlap=True)
    as_if_asynchronous(mixed, 0.5, seed)
    assert run(mixed, reqs) == serial, f"seed {seed}"

    engine = make_engine(checkpoint, overlap=True)
    launches = as_if_asynchronous(engine, 1.0, seed)
    for i in range(3):
        engine.add_request(f"d{i}", list(range(1 + i, 10 + i)), SamplingParams(max_tokens=8, min_tokens=8))
    assert engine.step() == [] and len(launches) == 1  # launched; nothing was in flight
    outs = engine.step()  # the first step is done: its tokens, and no launch
    assert len(launches) == 1 and engine._inflight is None
    assert sorted(o.req_id for o in outs) == ["d0", "d1", "d2"] and all(len(o.new_token_ids) == 1 for o in outs)
    assert engine.step() == [] and len(launches) == 2
    engine.runner.done = lambda handle: False  # the device is behind again: steps overlap
    got = engine.step()
    assert len(launches) == 3 and engine._inflight is not None and len(got) == 3
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_used == 0


def test_abort_during_an_inflight_step_frees_every_block(checkpoint):
    engine = make_engine(checkpoint, overlap=True)
    for i in range(6):
        engine.add_request(f"a{i}", list(range(1 + i, 30 + i)), SamplingParams(max_tokens=50, min_tokens=50))
    for _ in range(12):
        engine.step()
    assert engine._inflight is not None  # a step is launched and not taken in
    for i in range(0, 6, 2):
        assert engine.abort(f"a{i}")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    aborted = {o.req_id for o in outs if o.finish_reason == "abort"}
    assert aborted == {"a0", "a2", "a4"}
    # nothing came for an aborted request after its abort output
    for rid in aborted:
        rest = [o for o in outs if o.req_id == rid]
        assert rest[-1].finished and all(not o.new_token_ids for o in rest if o.finish_reason == "abort")
    assert engine.block_manager.num_used == 0
    assert not engine.requests


def test_stop_strings_and_lengths_end_exactly_through_the_engine_server(tiny_hf_dir):
    """The served path (engine server + core process, overlapped torch runner): a stop string ends the
    request at the token that completes it and max_dec_len at its length; nothing from the step that
    was already in flight leaks into the output, the usage or the text."""
    import time

    from llmserve.offline import LLM
    from llmserve.serving.engine_process import start
    from llmserve.serving.testing import free_ports
    from llmserve.utils.wire import dumps, loads
    from tests.test_engine import dealer

    llm = LLM(str(tiny_hf_dir), Config(block_size=4, max_seq_len=256, batch_size=8, block_bs=4))
    assert llm.engine.overlap
    prompts = ["def f(x):", "import os", "class A:", "for i in"]
    free = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    cases = []  # (prompt, stop string, tokens up to the stop string, text before it)
    for p, r in zip(prompts, free):
        for k in range(3, 20):  # the first token whose text starts a stop string not seen before it
            head, stop = llm.tokenizer.decode(r.token_ids[:k]), llm.tokenizer.decode(r.token_ids[k : k + 2])
            if stop.strip() and stop not in head + stop[:-1] and head + stop == r.text[: len(head + stop)]:
                cases.append((p, stop, k + 2, head))
                break
    assert cases
    # What the serial loop gives with each stop string: the served, overlapped path must give the same.
    serial = LLM(str(tiny_hf_dir), Config(block_size=4, max_seq_len=256, batch_size=8, overlap_scheduling=False))
    want = serial.generate(
        [p for p, *_ in cases],
        [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]) for _, stop, *_ in cases],
    )
    for w, (_, _stop, n, head) in zip(want, cases):
        assert w.finish_reason == "stop" and w.text == head and len(w.token_ids) >= n
    port = free_ports(1)[0]
    server = start(Config.from_env({}, model_dir=str(tiny_hf_dir), inter_proc_port=port, block_size=4, max_seq_len=256))
    client = dealer(port, b"c")
    try:
        for i, (p, stop, _, _) in enumerate(cases):
            body = {"text": p, "req_id": f"s{i}", "max_dec_len": 24, "top_k": 1, "stop": stop, "return_usage": True}
            client.send(dumps({"op": "add", "req_id": f"s{i}", "request": record(body | {"eos_token_ids": []})}))
        body = {
            "text": prompts[0],
            "req_id": "len",
            "max_dec_len": 7,
            "min_dec_len": 7,
            "top_k": 1,
            "return_usage": True,
        }
        client.send(dumps({"op": "add", "req_id": "len", "request": record(body)}))
        items: list[dict] = []
        deadline = time.monotonic() + 120
        while sum(i["is_end"] for i in items) < len(cases) + 1:
            assert time.monotonic() < deadline
            server.run_once(20)
            while client.poll(0):
                items += loads(client.recv()).get("items", [])
    finally:
        client.close(0)
        server._shutdown()
    for i, w in enumerate(want):
        mine = [x for x in items if x["req_id"] == f"s{i}"]
        final = mine[-1]
        assert final["error_code"] == 0 and final["finish_reason"] == "stop", final
        assert final["tokens_all"] == w.text and "".join(x["token"] for x in mine) == w.text
        assert [t for x in mine for t in x["token_ids"]] == w.token_ids
        assert final["usage"]["completion_tokens"] == len(w.token_ids)
    final = [x for x in items if x["req_id"] == "len"][-1]
    assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 7
