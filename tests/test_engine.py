"""The engine end to end on a real Paddle static graph (CPU), with fresh random weights.

Each property is checked against the same requests run alone, through the
same engine code, so a scheduler, cache or batching bug shows up as a
different token.
"""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from llmserve.config import Config
from llmserve.engine.llm_engine import DuplicateRequestError, LLMEngine
from llmserve.engine.sampler import Sampler
from llmserve.engine.sampling_params import SamplingParams
from llmserve.layers.model_config import ModelConfig
from llmserve.runners.paddle.export import export_random
from llmserve.runners.paddle.runner import PaddleRunner
from llmserve.serving.testing import record

VOCAB = 320
SEED = random.SystemRandom().randrange(1 << 30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = ModelConfig(
        architecture="llama",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        eos_token_ids=(VOCAB - 1,),
    )
    out = tmp_path_factory.mktemp("tiny")
    export_random(cfg, str(out), seed=SEED)
    return str(out)


def make_engine(model_dir, **overrides) -> LLMEngine:
    base = dict(max_seq_len=256, block_size=8, block_bs=4, batch_size=32, max_num_batched_tokens=64)
    base.update(overrides)
    config = Config.from_env(env={}, **base)
    return LLMEngine(config, PaddleRunner(model_dir, config, Sampler(0)))


def run_all(engine, prompts, params, arrive_at=None, abort_at=None):
    """Feed prompts (request i joins at step arrive_at[i]); return {i: tokens}."""
    arrive_at = arrive_at or [0] * len(prompts)
    abort_at = abort_at or {}
    outs = {i: [] for i in range(len(prompts))}
    finished = {}
    step = 0
    while len(finished) < len(prompts):
        for i, t in enumerate(arrive_at):
            if t == step:
                engine.add_request(f"r{i}", prompts[i], dataclasses.replace(params))
        for i, t in abort_at.items():
            if t == step:
                engine.abort(f"r{i}")
        for o in engine.step():
            i = int(o.req_id[1:])
            outs[i] += o.new_token_ids
            if o.finished:
                finished[i] = o.finish_reason
        step += 1
        assert step < 10_000, "engine made no progress"
    return outs, finished


def random_prompts(n, lo, hi, rng):
    return [[rng.randrange(VOCAB - 1) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_batch_invariance_staggered(model_dir):
    rng = random.Random(SEED)
    prompts = random_prompts(16, 1, 90, rng)
    alone = {i: run_all(make_engine(model_dir), [p], GREEDY)[0][0] for i, p in enumerate(prompts)}
    engine = make_engine(model_dir)
    together, reasons = run_all(engine, prompts, GREEDY, arrive_at=[rng.randrange(12) for _ in prompts])
    assert together == alone, f"seed {SEED}"
    assert set(reasons.values()) == {"length"}
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


def test_preemption_gives_same_outputs(model_dir):
    rng = random.Random(SEED + 1)
    prompts = random_prompts(8, 20, 40, rng)
    params = dataclasses.replace(GREEDY, max_tokens=24)
    alone = {i: run_all(make_engine(model_dir), [p], params)[0][0] for i, p in enumerate(prompts)}
    # 16 blocks of 8 tokens = 128 tokens: far less than 8 x ~55 tokens, so requests are preempted.
    small = make_engine(model_dir, max_seq_len=128, block_bs=1, block_ratio=1.0, enable_prefix_caching=False)
    together, _ = run_all(small, prompts, params)
    assert small.stats().preemptions > 0
    assert together == alone, f"seed {SEED}"
    assert small.block_manager.num_free == small.block_manager.num_blocks


def test_prefix_cache_reuses_blocks_with_identical_outputs(model_dir):
    rng = random.Random(SEED + 2)
    prefix = random_prompts(1, 40, 40, rng)[0]
    prompts = [prefix + tail for tail in random_prompts(6, 1, 10, rng)]
    uncached = run_all(make_engine(model_dir, enable_prefix_caching=False), prompts, GREEDY)[0]
    engine = make_engine(model_dir)
    # The first request fills the cache; the others arrive after it finished its prefill.
    cached = run_all(engine, prompts, GREEDY, arrive_at=[0] + [3] * 5)[0]
    stats = engine.stats()
    assert stats.prefix_cache_hits >= 5 * 40 // 8 * 8  # five requests x five full prefix blocks
    assert cached == uncached, f"seed {SEED}"


def test_every_block_free_after_finish_and_abort(model_dir):
    rng = random.Random(SEED + 3)
    prompts = random_prompts(10, 5, 60, rng)
    engine = make_engine(model_dir)
    _, reasons = run_all(engine, prompts, dataclasses.replace(GREEDY, max_tokens=20), abort_at={0: 2, 3: 5, 7: 0, 9: 9})
    assert reasons[0] == reasons[3] == reasons[7] == "abort"
    bm = engine.block_manager
    assert bm.num_free == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert not engine.has_unfinished()


def test_seeded_sampling_reproduces_in_any_batch(model_dir):
    rng = random.Random(SEED + 4)
    prompts = random_prompts(5, 3, 30, rng)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    alone = run_all(make_engine(model_dir), prompts[:1], params)[0][0]
    together = run_all(make_engine(model_dir), prompts, params, arrive_at=[2, 0, 1, 0, 3])[0]
    assert together[0] == alone
    again = run_all(make_engine(model_dir), prompts[:1], params)[0][0]
    assert again == alone


def test_eos_and_max_tokens_finish(model_dir):
    engine = make_engine(model_dir)
    eos = VOCAB - 1
    params = SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[])
    outs, reasons = run_all(engine, [[1, 2, 3]], params)
    assert len(outs[0]) <= 5
    assert reasons[0] == ("stop" if outs[0][-1] == eos else "length")


def test_bad_requests_are_rejected(model_dir):
    engine = make_engine(model_dir)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("a", [VOCAB + 5], SamplingParams())
    with pytest.raises(ValueError, match="at most"):
        engine.add_request("a", [1] * 300, SamplingParams())
    engine.add_request("a", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(DuplicateRequestError):
        engine.add_request("a", [1, 2], SamplingParams())


def test_aborted_req_id_stays_in_flight_until_its_final_output(model_dir):
    engine = make_engine(model_dir)
    engine.add_request("a", [1, 2, 3], dataclasses.replace(GREEDY, max_tokens=50))
    engine.step()
    assert engine.abort("a")
    with pytest.raises(DuplicateRequestError):  # its abort output is still to come: the id is taken
        engine.add_request("a", [4, 5], dataclasses.replace(GREEDY))
    assert [(o.req_id, o.finish_reason) for o in engine.step()] == [("a", "abort")]
    outs, reasons = run_all(engine, [[4, 5]], dataclasses.replace(GREEDY, max_tokens=3))  # free again
    assert len(outs[0]) == 3 and reasons[0] == "length" and not engine.requests


@pytest.fixture
def engine_server(demo_dir):
    """The engine server with its real core process (demo model), its ROUTER on a free port;
    the test drives its loop with `pump` (no thread)."""
    from llmserve.serving.engine_process import start
    from llmserve.serving.testing import free_ports

    port = free_ports(1)[0]
    server = start(Config.from_env({}, model_dir=demo_dir, inter_proc_port=port))
    yield server
    server._shutdown()
    assert not server.core.alive()


def test_a_taken_inter_proc_port_fails_at_once_naming_the_setting(demo_dir):
    """The engine server listens before it starts the core (or loads anything): a port held by another
    socket is refused at once, with a message naming INTER_PROC_PORT."""
    import socket

    from llmserve.serving.engine_process import start

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=f"INTER_PROC_PORT={port}: cannot listen"):
            start(Config.from_env({}, model_dir=demo_dir, inter_proc_port=port))
        assert time.monotonic() - t0 < 5  # before any model is loaded
    finally:
        holder.close()


def pump(server, done, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        assert server.run_once(20)


def dealer(port: int, name: bytes):
    import zmq

    from llmserve.serving.ipc import endpoint

    c = zmq.Context.instance().socket(zmq.DEALER)
    c.setsockopt(zmq.LINGER, 0)
    c.setsockopt(zmq.ROUTING_ID, name)
    c.connect(endpoint(port))
    return c


def received(client, items: list) -> list:
    from llmserve.serving.ipc import loads

    while client.poll(0):
        items += loads(client.recv()).get("items", [])
    return items


def test_engine_server_takes_records_as_checked(engine_server, monkeypatch):
    """The engine server validates nothing again: with every pydantic entry point of the native request
    broken, records (made where the request entered) are still admitted and served; a message that is
    not a record is refused with a 400."""
    from llmserve.protocol import native
    from llmserve.serving.ipc import dumps

    server = engine_server
    recs = [record({"input_ids": [1, 2, 3], "req_id": f"v{i}", "max_tokens": 3, "stop": "zz"}) for i in range(3)]

    def boom(*a, **k):
        raise AssertionError("validated again")

    monkeypatch.setattr(native, "parse", boom)
    monkeypatch.setattr(native.NativeRequest, "model_validate", boom)
    monkeypatch.setattr(native.NativeRequest, "__init__", boom)
    client = dealer(server.cfg.inter_proc_port, b"records")
    items: list = []
    try:
        for rec in recs:
            client.send(dumps({"op": "add", "req_id": rec["req_id"], "request": rec}))
        client.send(dumps({"op": "add", "req_id": "junk", "request": ["not", "a", "record"]}))
        pump(server, lambda: sum(i["is_end"] for i in received(client, items)) == 4)
        finals = {i["req_id"]: i for i in items if i["is_end"]}
        assert all(finals[r["req_id"]]["error_code"] == 0 for r in recs), finals
        assert sum(len(i.get("token_ids") or []) for i in items if i["req_id"] == "v0") == 3
        assert finals["junk"]["error_code"] == 400 and "not a request record" in finals["junk"]["error_msg"]
    finally:
        client.close(0)


def test_engine_server_cancel_then_same_req_id(engine_server):
    """A client's abort and, right after it, a new request with that req_id: the aborted one sends
    nothing more (no final output), the new one runs to its own end; every block is freed."""
    from llmserve.serving.ipc import dumps

    server = engine_server
    client = dealer(server.cfg.inter_proc_port, b"c")
    body = {"input_ids": [1, 2, 3], "req_id": "x", "max_dec_len": 100, "min_dec_len": 100}
    items: list = []
    try:
        client.send(dumps({"op": "add", "request": record(body)}))
        pump(server, lambda: received(client, items))
        client.send(dumps({"op": "abort", "req_id": "x"}))
        new = body | {"max_dec_len": 5, "min_dec_len": 5, "return_usage": True}
        client.send(dumps({"op": "add", "request": record(new)}))
        pump(server, lambda: any(i["is_end"] for i in received(client, items)))
        pump(server, lambda: server.kv[2] == 0 and not server.live)  # the core reports its blocks free
        finals = [i for i in items if i["is_end"]]
        assert len(finals) == 1 and finals[0]["error_code"] == 0
        assert finals[0]["usage"]["completion_tokens"] == 5 and finals[0]["finish_reason"] == "length"
    finally:
        client.close(0)


def test_engine_server_admits_a_burst_up_to_the_batch_and_its_queue(demo_dir):
    """A burst sent at once (its texts encoded together): the BATCH_SIZE that will run and
    MAX_CACHED_TASK_NUM more are admitted, the rest get 429 naming the setting; each admitted request's
    text is the one it gets alone (its prompt's ids are its own)."""
    from llmserve.serving.engine_process import start
    from llmserve.serving.ipc import dumps
    from llmserve.serving.testing import free_ports

    port = free_ports(1)[0]
    server = start(Config.from_env({}, model_dir=demo_dir, inter_proc_port=port, batch_size=4, max_cached_task_num=2))
    client = dealer(port, b"burst")
    prompts = ["def f(x):\n", "import os\n", "class A:\n", "for i in range(3):\n", "x = [", "while True:\n"]
    body = {"max_dec_len": 6, "min_dec_len": 6, "temperature": 0}
    items: list = []
    try:
        for i, p in enumerate(prompts + ["z = 1\n", "print(", "# a", "y"]):  # 4 + 2 fit, 4 more
            client.send(dumps({"op": "add", "request": record(body | {"text": p, "req_id": f"b{i}"})}))
        pump(server, lambda: sum(i["is_end"] for i in received(client, items)) == len(prompts) + 4)
        ends = {i["req_id"]: i for i in items if i["is_end"]}
        rejected = [r for r, i in ends.items() if i["error_code"] == 429]
        assert sorted(rejected) == ["b6", "b7", "b8", "b9"] and all(
            "MAX_CACHED_TASK_NUM" in ends[r]["error_msg"] for r in rejected
        )
        burst = {r: "".join(i.get("result", "") for i in items if i["req_id"] == r) for r in ends if r not in rejected}
        for i, p in enumerate(prompts):  # alone, one after another
            alone: list = []
            client.send(dumps({"op": "add", "request": record(body | {"text": p, "req_id": f"a{i}"})}))
            pump(server, lambda alone=alone: any(i["is_end"] for i in received(client, alone)))
            assert "".join(i.get("result", "") for i in alone) == burst[f"b{i}"], p
    finally:
        client.close(0)
        server._shutdown()


def test_engine_server_admits_a_burst_a_slice_at_a_time(engine_server, monkeypatch):
    """A burst is parsed ADMIT_SLICE bodies at a time and each slice is handed to the core before the
    next is parsed (the core starts on the first while the rest are parsed); every request still runs,
    in the order sent."""
    from llmserve.protocol import native
    from llmserve.serving import engine_server as es
    from llmserve.serving.ipc import dumps

    server = engine_server
    calls: list[tuple[int, int]] = []  # (bodies parsed, requests sent to the core before)
    parse = native.tokenize_burst
    monkeypatch.setattr(native, "tokenize_burst", lambda b, t: calls.append((len(b), server.adds_sent)) or parse(b, t))
    client = dealer(server.cfg.inter_proc_port, b"slices")
    n = 2 * es.ADMIT_SLICE + 5
    items: list = []
    try:
        for i in range(n):
            body = {"input_ids": [1 + i % 7, 2, 3], "req_id": f"s{i}", "max_dec_len": 2, "min_dec_len": 2}
            client.send(dumps({"op": "add", "request": record(body)}))
        time.sleep(0.2)  # all of them queued at the ROUTER: one round takes them together
        pump(server, lambda: sum(i["is_end"] for i in received(client, items)) == n)
        sizes = [size for size, _ in calls]
        assert sum(sizes) == n and max(sizes) <= es.ADMIT_SLICE and len(calls) >= 3, calls
        before = [sent for _, sent in calls]
        assert before == [before[0] + sum(sizes[:k]) for k in range(len(sizes))], calls  # each slice sent first
        ends = [i for i in items if i["is_end"]]
        assert all(e["error_code"] == 0 for e in ends) and {e["req_id"] for e in ends} == {f"s{i}" for i in range(n)}
    finally:
        client.close(0)


def test_engine_server_aborts_the_requests_of_a_client_that_is_gone(engine_server):
    """A client whose connection closed (a killed Triton stub) gets its requests aborted and their KV
    blocks freed at the next send to it; another client's requests run on."""
    from llmserve.serving.ipc import dumps

    server = engine_server
    old, new = dealer(server.cfg.inter_proc_port, b"old"), dealer(server.cfg.inter_proc_port, b"new")
    body = {"input_ids": [1, 2, 3], "max_dec_len": 200, "min_dec_len": 200}
    items: list = []
    try:
        old.send(dumps({"op": "add", "request": record(body | {"req_id": "o1"})}))
        old.send(dumps({"op": "add", "request": record(body | {"req_id": "o2"})}))
        new.send(dumps({"op": "add", "request": record(body | {"req_id": "n1"})}))
        pump(server, lambda: set(server.live) == {"o1", "o2", "n1"} and server.kv[2] > 0)
        assert not server.gone
        old.close(0)  # the process died: its connection closes
        pump(server, lambda: set(server.live) == {"n1"})  # noticed at a send (a step's items, a heartbeat)
        assert server.cancelled == 2
        pump(server, lambda: any(i["is_end"] for i in received(new, items)), timeout=120)  # n1 ran to its end
        pump(server, lambda: not server.live and server.kv[2] == 0)
        got = sum(len(i["token_ids"]) for i in items)
        assert got == 200 and not server.gone
    finally:
        for c in (old, new):
            c.close(0)
