"""The Triton adapter (llmserve.triton.model) when it falls behind the engine.

- `coalesce`, the pure merge of a burst of engine items: random interleavings of
  several requests' items (hypothesis);
- the adapter's IO thread against a fake engine (a ZMQ ROUTER in this process,
  a stand-in `triton_python_backend_utils`): send_idx numbering, merged bursts,
  the hang rule (silence, or a heartbeat's `stalled`), aborts queued on a hang;
- the real stack (slow): the Python-backend stub is SIGSTOPped for 1.5 s under
  long greedy streams; once resumed, its backlog goes out merged, every token
  in order, send_idx without gaps, and the supervisor restarts nothing.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import random
import signal
import sys
import threading
import time
import types
import uuid
from pathlib import Path

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.protocol import ABORT_PARAM, CANCELLED
from llmserve.serving.ipc import EngineLink, dumps, loads
from llmserve.serving.testing import ServingStack, free_ports, process_tree, wait_until

# ---- the adapter module, importable without Triton ------------------------------------------
PB = "triton_python_backend_utils"


class _Tensor:
    def __init__(self, name: str, array) -> None:
        self.name, self.array = name, array

    def as_numpy(self):
        return self.array


class _Response:
    def __init__(self, output_tensors: list) -> None:
        self.output_tensors = output_tensors


def _fake_pb_utils() -> types.ModuleType:
    m = types.ModuleType(PB)
    m.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    m.Tensor = _Tensor
    m.InferenceResponse = _Response
    m.get_input_tensor_by_name = lambda request, name: request.inputs[name]
    return m


@pytest.fixture(scope="module")
def adapter():
    """llmserve.triton.model imported against a stand-in pb_utils (restored afterwards)."""
    saved = {k: sys.modules.pop(k, None) for k in (PB, "llmserve.triton.model")}
    sys.modules[PB] = _fake_pb_utils()
    try:
        yield importlib.import_module("llmserve.triton.model")
    finally:
        for k, v in saved.items():
            sys.modules.pop(k, None)
            if v is not None:
                sys.modules[k] = v


# ---- coalesce: random interleavings -----------------------------------------------------------
def _life(draw, rid: str, logprobs: bool, must_end: bool) -> list[dict]:
    """One request's items in the engine's order: tokens, then a final, an error, or nothing yet."""
    items = []
    for _ in range(draw(st.integers(0, 6))):
        ids = draw(st.lists(st.integers(0, 50_000), min_size=0, max_size=3))
        item = {
            "req_id": rid,
            "token": draw(st.text(max_size=4)),
            "token_ids": ids,
            "is_end": 0,
            "send_idx": draw(st.integers(0, 99)),  # today's engine numbers them: the adapter must not care
            "error_code": 0,
            "error_msg": "",
        }
        if logprobs:
            item["logprobs"] = [{"token_id": t, "logprob": -1.0 * t} for t in ids]
        items.append(item)
    end = draw(st.sampled_from(["final", "error"] if must_end else ["final", "error", "open"]))
    if end == "final":
        ids = draw(st.lists(st.integers(0, 50_000), max_size=3))
        final = {
            "req_id": rid,
            "token": draw(st.text(max_size=4)),
            "token_ids": ids,
            "is_end": 1,
            "error_code": 0,
            "error_msg": "",
            "tokens_all": "".join(i["token"] for i in items),
            "finish_reason": draw(st.sampled_from(["stop", "length"])),
        }
        if logprobs:
            final["logprobs"] = [{"token_id": t, "logprob": -0.5} for t in ids]
        if draw(st.booleans()):
            final["usage"] = {"completion_tokens": draw(st.integers(0, 99))}
        items.append(final)
    elif end == "error":
        items.append({"req_id": rid, "is_end": 1, "error_code": draw(st.sampled_from([408, 500])), "error_msg": "x"})
    return items


@st.composite
def bursts(draw):
    """Several requests' items, interleaved at random, each request's own order kept. A req_id may
    live twice in one burst (ended, then reused by a new request)."""
    seqs = []
    for r in range(draw(st.integers(1, 5))):
        rid, lp = f"r{r}", draw(st.booleans())
        lives = draw(st.integers(1, 2))
        seqs.append([i for k in range(lives) for i in _life(draw, rid, lp, must_end=k < lives - 1)])
    order = draw(st.permutations([r for r, s in enumerate(seqs) for _ in s]))
    pos = [0] * len(seqs)
    items = []
    for r in order:
        items.append(seqs[r][pos[r]])
        pos[r] += 1
    return items


def _lives(items: list[dict]) -> dict[str, list[list[dict]]]:
    """req_id -> its lives: runs of items, each closed by a final (is_end or error)."""
    out: dict[str, list[list[dict]]] = {}
    open_: dict[str, list[dict]] = {}
    for i in items:
        rid = i["req_id"]
        if rid not in open_:
            open_[rid] = []
            out.setdefault(rid, []).append(open_[rid])
        open_[rid].append(i)
        if i.get("is_end") or i.get("error_code"):
            del open_[rid]
    return out


def _cat(items: list[dict], key: str):
    return [x for i in items for x in i.get(key, [])]


@settings(max_examples=400, deadline=None)
@given(bursts())
def test_coalesce_keeps_every_token_in_order(adapter, items):
    before = copy.deepcopy(items)
    out = adapter.coalesce(items)
    assert items == before  # the input is left alone
    lives_in, lives_out = _lives(items), _lives(out)
    assert lives_in.keys() == lives_out.keys()
    for rid, ins in lives_in.items():
        outs = lives_out[rid]
        assert len(outs) == len(ins)
        for a, b in zip(ins, outs):
            toks_a = [i for i in a if not i.get("error_code")]
            toks_b = [i for i in b if not i.get("error_code")]
            # Every token, in order: texts, ids, logprobs.
            assert "".join(i.get("token", "") for i in toks_b) == "".join(i.get("token", "") for i in toks_a)
            assert _cat(toks_b, "token_ids") == _cat(toks_a, "token_ids")
            assert _cat(toks_b, "logprobs") == _cat(toks_a, "logprobs")
            # Merged: at most one token response per life (the whole burst is at hand).
            assert len(toks_b) == min(1, len(toks_a))
            # The final is last, and only it is final.
            assert [bool(i.get("is_end") or i.get("error_code")) for i in b[:-1]] == [False] * (len(b) - 1)
            last_a, last_b = a[-1], b[-1]
            if last_a.get("error_code"):
                assert last_b == last_a  # the error itself, after the tokens merged before it
                assert len(b) == 1 + len(toks_b)
            elif last_a.get("is_end"):
                assert last_b["is_end"] == 1
                for k in ("tokens_all", "finish_reason", "usage"):
                    assert last_b.get(k) == last_a.get(k)
            else:
                assert not last_b.get("is_end")
    # Requests (each life of a req_id) keep the order of their first appearance.
    assert _firsts(out) == _firsts(items)


@settings(max_examples=200, deadline=None)
@given(bursts())
def test_requests_that_end_are_sent_first(adapter, items):
    merged = adapter.coalesce(items)
    out = adapter.finals_first(merged)
    assert sorted(map(id, out)) == sorted(map(id, merged))  # the same items, none dropped or added
    for rid in {i["req_id"] for i in merged}:  # each request's items in their order
        assert [i for i in out if i["req_id"] == rid] == [i for i in merged if i["req_id"] == rid]
    ending = [
        bool(any(j.get("is_end") or j.get("error_code") for j in merged if j["req_id"] == i["req_id"])) for i in out
    ]
    assert ending == sorted(ending, reverse=True)  # every item of a request that ends comes before the others'


def _firsts(items: list[dict]) -> list[tuple[str, int]]:
    """(req_id, life) in the order of first appearance."""
    keys, lives = [], {}
    for i in items:
        rid = i["req_id"]
        key = (rid, lives.get(rid, 0))
        if not keys or key not in keys:
            keys.append(key)
        if i.get("is_end") or i.get("error_code"):
            lives[rid] = key[1] + 1
    return keys


def test_coalesce_examples(adapter):
    def tok(r, t, ids, **kw):
        return {"req_id": r, "token": t, "token_ids": ids, "is_end": 0, "error_code": 0, "error_msg": "", **kw}

    items = [
        tok("a", "he", [1], logprobs=[{"token_id": 1}]),
        tok("b", "x", [9]),
        tok("a", "llo", [2, 3], logprobs=[{"token_id": 2}, {"token_id": 3}]),
        tok("b", "y", [8]),
        {"req_id": "b", "is_end": 1, "error_code": 408, "error_msg": "timed out"},
        tok("a", "!", [4], logprobs=[{"token_id": 4}], is_end=1, tokens_all="hello!", finish_reason="length"),
    ]
    out = adapter.coalesce(items)
    assert out == [
        tok(
            "a",
            "hello!",
            [1, 2, 3, 4],
            logprobs=[{"token_id": t} for t in (1, 2, 3, 4)],
            is_end=1,
            tokens_all="hello!",
            finish_reason="length",
        ),
        tok("b", "xy", [9, 8]),
        {"req_id": "b", "is_end": 1, "error_code": 408, "error_msg": "timed out"},
    ]
    # One item per request (the engine's pace): nothing to merge, the very same dicts.
    step = [tok("a", "p", [1]), tok("b", "q", [2])]
    assert all(x is y for x, y in zip(adapter.coalesce(step), step))
    assert adapter.coalesce([]) == []


# ---- the adapter's IO thread against a fake engine -------------------------------------------
class _Sender:
    def __init__(self) -> None:
        self.got: list[tuple[dict | None, int]] = []
        self.done = threading.Event()
        self.delay = 0.0  # seconds a send takes (tritonserver taking the response)
        self.sent_at = 0.0

    def send(self, response=None, flags: int = 0) -> None:
        time.sleep(self.delay)
        msg = None if response is None else json.loads(response.output_tensors[0].as_numpy()[0])
        self.got.append((msg, flags))
        self.sent_at = time.monotonic()
        if flags:
            self.done.set()

    def is_cancelled(self) -> bool:
        return False


class _Request:
    def __init__(self, body: dict, parameters: dict | None = None) -> None:
        self.inputs = {"IN": _Tensor("IN", np.array([json.dumps(body).encode()], dtype=np.object_))}
        self.sender = _Sender()
        self._parameters = json.dumps(parameters or {})

    def parameters(self) -> str:  # as Triton's: the request's parameters as JSON text
        return self._parameters

    def get_response_sender(self) -> _Sender:
        return self.sender

    def request_id(self) -> str:
        return ""


class FakeEngine:
    """The engine's ROUTER end of the wire, driven by the test."""

    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.client: bytes | None = None
        self.got: list[dict] = []

    def recv(self, timeout: float = 0.2) -> list[dict]:
        new, deadline = [], time.monotonic() + timeout
        while self.sock.poll(max(0, int(1000 * (deadline - time.monotonic())))):
            self.client, raw = self.sock.recv_multipart()
            new.append(loads(raw))
        self.got += new
        return new

    def wait_for(self, pred, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not pred(self.got):
            assert time.monotonic() < deadline, self.got
            self.recv(0.05)

    def send(self, msg: dict) -> None:
        self.sock.send_multipart([self.client, dumps(msg)])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


LIMIT = 1.0  # CHECK_HEALTH_INTERVAL of the fake-engine tests


@pytest.fixture
def wired(adapter, monkeypatch):
    """(model, engine): an initialized TritonPythonModel linked to a FakeEngine."""
    (port,) = free_ports(1)
    monkeypatch.setenv("INTER_PROC_PORT", str(port))
    monkeypatch.setenv("CHECK_HEALTH_INTERVAL", str(LIMIT))
    engine = FakeEngine(port)
    model = adapter.TritonPythonModel()
    model.initialize({})
    engine.wait_for(lambda got: any(m["op"] == "hello" for m in got))
    assert model.connected
    yield model, engine
    model.finalize()
    model.push.close(0)
    engine.close()


def _submit(model, engine, n: int) -> list[_Request]:
    reqs = [_Request({"req_id": f"q{k}-{uuid.uuid4().hex[:6]}", "text": "hi"}) for k in range(n)]
    model.execute(reqs)
    engine.wait_for(lambda got: sum(m["op"] == "add" for m in got) >= n)
    adds = [m for m in engine.got if m["op"] == "add"]
    for r, m in zip(reqs, adds[-n:]):
        body = m["request"]  # the checked record, its req_id beside it
        assert isinstance(body, dict) and body["req_id"] == m["req_id"] == _rid(r) and body["text"] == "hi"
    return reqs


def _rid(r: _Request) -> str:
    return json.loads(r.inputs["IN"].as_numpy()[0])["req_id"]


def test_adapter_numbers_and_merges_a_backlog(wired):
    model, engine = wired
    a, b = _submit(model, engine, 2)
    ra, rb = _rid(a), _rid(b)

    def item(rid, k, end=False):
        it = {"req_id": rid, "token": f"<{k}>", "token_ids": [k], "is_end": int(end), "error_code": 0}
        it |= {"error_msg": "", "send_idx": 1000 + k}  # today's engine sends its own: overwritten
        return it | ({"tokens_all": "".join(f"<{j}>" for j in range(k + 1)), "finish_reason": "length"} if end else {})

    engine.send({"op": "out", "items": [item(ra, 0), item(rb, 0)]})
    engine.send({"op": "hb", "stalled": 0.1})
    deadline = time.monotonic() + 5
    while not (a.sender.got and b.sender.got):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # A backlog: the IO thread is held (it needs the lock to deliver) while 30 steps pile up.
    with model.lock:
        time.sleep(0.15)  # it takes whatever is there now, then waits on the lock
        for k in range(1, 30):
            engine.send({"op": "out", "items": [item(ra, k, end=k == 29), item(rb, k)]})
        engine.send({"op": "out", "items": [{"req_id": rb, "is_end": 1, "error_code": 408, "error_msg": "late"}]})
        time.sleep(0.2)
    assert a.sender.done.wait(5) and b.sender.done.wait(5)
    for r, rid in ((a, ra), (b, rb)):
        msgs = [m for m, _ in r.sender.got]
        assert {m["req_id"] for m in msgs} == {rid}
        assert [f for _, f in r.sender.got] == [0] * (len(msgs) - 1) + [1]
        toks = [m for m in msgs if not m["error_code"]]
        assert [m["send_idx"] for m in toks] == list(range(len(toks)))
        assert _cat(toks, "token_ids") == list(range(30))
        assert "".join(m["token"] for m in toks) == "".join(f"<{k}>" for k in range(30))
        assert len(toks) <= 3  # 30 steps, merged: the first, perhaps one more, and the rest at once
    assert a.sender.got[-1][0]["tokens_all"] == "".join(f"<{k}>" for k in range(30))
    assert b.sender.got[-1][0] == {"req_id": rb, "is_end": 1, "error_code": 408, "error_msg": "late"}
    assert model.senders == {} and model.send_idx == {}  # nothing kept for ended requests
    # The req_id is free again, numbered from 0.
    (c,) = [_Request({"req_id": ra, "text": "hi"})]
    model.execute([c])
    engine.wait_for(lambda got: sum(m["op"] == "add" for m in got) >= 3)
    engine.send({"op": "out", "items": [item(ra, 0)]})
    engine.send({"op": "out", "items": [item(ra, 1, end=True)]})
    assert c.sender.done.wait(5)
    assert [m["send_idx"] for m, _ in c.sender.got] in ([0, 1], [0])


def test_requests_that_come_during_a_round_go_on_within_it(wired):
    """A client sends its next request on the final response, which goes first in a round: that
    request must reach the engine while the round's other responses are still being sent."""
    model, engine = wired
    reqs = _submit(model, engine, 32)
    for r in reqs:
        r.sender.delay = 0.005  # 32 responses: a round of ~160 ms
    items = [{"req_id": _rid(r), "token": "x", "token_ids": [1], "is_end": 0, "error_code": 0} for r in reqs]
    engine.send({"op": "out", "items": items})
    deadline = time.monotonic() + 5
    while not reqs[0].sender.got:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    model.execute([_Request({"req_id": "next", "text": "hi"})])  # from another thread, as Triton's
    engine.wait_for(lambda got: any(m["op"] == "add" and m["req_id"] == "next" for m in got))
    forwarded = time.monotonic()
    assert all(r.sender.done.wait(0) is False for r in reqs)
    while not reqs[-1].sender.got:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert forwarded < reqs[-1].sender.sent_at  # not after the round


def test_adapter_fails_requests_on_a_stalled_step(wired):
    model, engine = wired
    reqs = _submit(model, engine, 3)
    t0 = time.monotonic()
    # Heartbeats keep coming (the engine lives), a step is slow but below the limit: nothing fails.
    while time.monotonic() - t0 < 2.5 * LIMIT:
        engine.send({"op": "hb", "stalled": 0.8 * LIMIT})
        time.sleep(0.1)
    assert not any(r.sender.got for r in reqs)
    engine.send({"op": "hb", "stalled": LIMIT + 0.5})
    for r in reqs:
        assert r.sender.done.wait(2)
        ((msg, flags),) = r.sender.got
        assert msg["error_code"] == 500 and "not responding" in msg["error_msg"] and flags == 1
    # Their aborts are queued for the engine, should it resume.
    engine.wait_for(lambda got: {m.get("req_id") for m in got if m["op"] == "abort"} == {_rid(r) for r in reqs})
    assert model.senders == {}


def test_adapter_abort_requests(wired):
    """An abort request (ABORT_PARAM) reaches the engine after the add it names (one pipe); a request of
    this adapter's ends at once with CANCELLED, its numbering forgotten at the next cancel check; the
    abort request itself gets an empty final response; one for a req_id held elsewhere only goes on."""
    model, engine = wired
    a, b = _submit(model, engine, 2)
    engine.send({"op": "out", "items": [{"req_id": _rid(a), "token": "x", "token_ids": [1], "is_end": 0}]})
    assert wait_until(lambda: a.sender.got, 3)
    aborts = [
        _Request({"req_id": _rid(a)}, {ABORT_PARAM: True}),
        _Request({"req_id": "elsewhere"}, {ABORT_PARAM: True}),
    ]
    model.execute(aborts)
    engine.wait_for(lambda got: [m["req_id"] for m in got if m["op"] == "abort"] == [_rid(a), "elsewhere"])
    assert [m["op"] for m in engine.got if m["op"] != "hb"][-4:] == ["add", "add", "abort", "abort"]
    msg, flags = a.sender.got[-1]
    assert msg["error_code"] == CANCELLED and msg["req_id"] == _rid(a) and flags == 1
    assert [r.sender.got for r in aborts] == [[(None, 1)], [(None, 1)]]
    assert list(model.senders) == [_rid(b)] and not b.sender.got
    assert wait_until(lambda: _rid(a) not in model.send_idx, 3)


def test_adapter_fails_requests_when_the_engine_goes_silent(wired):
    model, engine = wired
    reqs = _submit(model, engine, 2)
    engine.send({"op": "out", "items": [{"req_id": _rid(reqs[0]), "token": "a", "token_ids": [1], "is_end": 0}]})
    t0 = time.monotonic()
    for r in reqs:  # no message at all (the process is stopped): failed after CHECK_HEALTH_INTERVAL
        assert r.sender.done.wait(LIMIT + 3)
        msg, flags = r.sender.got[-1]
        assert msg["error_code"] == 500 and "not responding" in msg["error_msg"] and flags == 1
    assert LIMIT - 0.2 < time.monotonic() - t0 < LIMIT + 2
    assert reqs[0].sender.got[0][0]["send_idx"] == 0
    engine.wait_for(lambda got: {m.get("req_id") for m in got if m["op"] == "abort"} == {_rid(r) for r in reqs})


# ---- the real stack: a stopped stub, then its backlog ------------------------------------------
tritonclient = pytest.importorskip("tritonclient.grpc")
from llmserve.serving.supervisor import STUB, stub_state  # noqa: E402
from llmserve.serving.testing import record  # noqa: E402
from llmserve.triton.client import TritonStream, collect  # noqa: E402

N_TOKENS = 200
WORDS = "river stone quiet lamp orbit maple signal harbor velvet echo copper meadow lantern drift".split()


def _engine_alone(port: int, body: dict, timeout: float = 120) -> list[int]:
    """The request alone, straight to the engine process (no adapter): its token_ids."""
    link = EngineLink(port, "adapter", f"ref-{uuid.uuid4().hex[:6]}", zmq.Context())
    try:
        deadline = time.monotonic() + 10
        while not link.connected:
            assert time.monotonic() < deadline, "no engine link"
            link.monitor.poll(100)
            link.events()
        body = {**body, "req_id": f"ref-{uuid.uuid4()}"}
        assert link.send({"op": "add", "req_id": body["req_id"], "request": record(body)})
        ids, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            if link.sock.poll(500):
                for msg in link.recv_all():
                    for it in msg.get("items", ()) if msg["op"] == "out" else ():
                        assert it["error_code"] == 0, it
                        ids += it["token_ids"]
                        if it["is_end"]:
                            return ids
        raise TimeoutError(body)
    finally:
        link.close()


@pytest.mark.slow
def test_stopped_stub_catches_up_with_merged_responses(tmp_path, demo_dir):
    env = {"MAX_SEQ_LEN": 1024, "MAX_DEC_LEN": 512, "BLOCK_BS": 8, "CHECK_HEALTH_INTERVAL": 30}
    stack = ServingStack(tmp_path, **env)
    stack.env.pop("MODEL_DIR", None)  # the demo model (built by the demo_dir fixture)
    stack.start()
    client = None
    try:
        client = TritonStream(stack.grpc_url)
        rng = random.Random(os.getpid())
        prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))) for _ in range(4)]
        body = {"max_dec_len": N_TOKENS, "min_dec_len": N_TOKENS, "temperature": 0, "return_usage": True}
        triton = stack.child_pid("tritonserver")
        (stub,) = [p for p in process_tree(triton) if STUB in Path(f"/proc/{p}/cmdline").read_bytes().decode()]
        queues = [client.submit({"text": p, **body}) for p in prompts]
        firsts = [q.get(timeout=60) for q in queues]  # all running
        assert all(m["error_code"] == 0 and not m["is_end"] for m in firsts), firsts
        os.kill(stub, signal.SIGSTOP)
        try:
            time.sleep(1.5)  # the engine streams on into the stub's queue
            assert stub_state(triton) == (1, 0)  # stopped is not dead: the supervisor leaves Triton be
        finally:
            os.kill(stub, signal.SIGCONT)
        streams = [[m, *collect(q, timeout=120)] for m, q in zip(firsts, queues)]
        n_msgs = n_toks = 0
        for msgs in streams:
            assert all(m["error_code"] == 0 for m in msgs), msgs[-1]
            assert [m["send_idx"] for m in msgs] == list(range(len(msgs)))
            assert [m["is_end"] for m in msgs] == [0] * (len(msgs) - 1) + [1]
            assert "".join(m["token"] for m in msgs) == msgs[-1]["tokens_all"]
            ids = _cat(msgs, "token_ids")
            assert len(ids) == N_TOKENS == msgs[-1]["usage"]["completion_tokens"]
            n_msgs, n_toks = n_msgs + len(msgs), n_toks + len(ids)
        assert max(len(m["token_ids"]) for s in streams for m in s) > 1  # the backlog went out merged
        assert n_msgs < n_toks
        # The same requests alone, past the adapter, greedy: the very same tokens.
        for p, msgs in zip(prompts, streams):
            assert _engine_alone(stack.ports["INTER_PROC_PORT"], {"text": p, **body}) == _cat(msgs, "token_ids")
        # Nothing was declared hung or restarted.
        assert stack.child_pid("tritonserver") == triton and stub in process_tree(triton)
        assert stack.ready()[0] == 200
        assert "stub died" not in (stack.log_dir / "server.log").read_text(errors="replace")
    finally:
        try:
            os.kill(stub, signal.SIGCONT)  # never leave it stopped
        except (NameError, ProcessLookupError):
            pass
        if client is not None:
            client.close()
        r = stack.stop()
        assert r.returncode == 0, r.stderr
