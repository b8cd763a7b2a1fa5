"""The engine core waits, while a step runs on the device, for the requests that replace those that
just finished (serving/arrival_wait.py): so they join the next step, as in-process ones do.

A real engine (the torch runner on the CPU, overlapped steps) and a real ZMQ PAIR link; the test is
the engine server's side of it."""

from __future__ import annotations

import time

import pytest
import zmq

from llmserve.config import Config
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.step_time import StepTimes
from llmserve.serving.arrival_wait import BUCKET_S, CAP_S, IDLE_SHARE, ArrivalWait
from llmserve.serving.engine_core import EngineCore
from llmserve.serving.ipc import dumps


def test_the_free_wait_is_half_a_step_at_most_the_cap():
    aw = ArrivalWait()
    assert aw.free(1.0) == CAP_S  # capped
    assert aw.free(0.008) == pytest.approx(0.004)  # half a step: the step in flight covers it


def test_extending_needs_answering_clients_and_budget():
    aw = ArrivalWait()
    assert aw.may_extend(0.0)  # clients are taken to answer until seen otherwise
    t = 100.0
    for i in range(20):  # finishes nobody answers within CAP_S (an open-loop load)
        aw.finished(1, t + i)
    aw.arrived(t + 30)  # 10 s late: expires the last one, answers none
    aw.finished(1, t + 31)
    aw.arrived(t + 30.5)  # came before that finish: not its successor
    assert len(aw.unanswered) == 1
    assert aw.answered < 0.5 and not aw.may_extend(0.0) and not aw.stats.delays
    for i in range(40):  # closed loop: each finish answered 3 ms later
        aw.finished(1, t + 40 + i)
        aw.arrived(t + 40 + i + 0.003)
    assert aw.may_extend(0.0) and aw.stats.delays[-1] == pytest.approx(0.003)
    aw.charge(BUCKET_S)  # the device idled the whole budget away
    assert not aw.may_extend(0.0)
    aw.busy(1.0)  # a second of steps earns IDLE_SHARE of it back
    assert aw.bucket == pytest.approx(IDLE_SHARE) and aw.may_extend(IDLE_SHARE / 2)
    assert not aw.may_extend(IDLE_SHARE)
    aw.busy(3600.0)
    assert aw.bucket == BUCKET_S  # bounded: a long busy stretch buys no long idle burst


def test_a_new_busy_stretch_takes_its_clients_to_answer():
    """A load's last finishes go unanswered because it ended: the next load starts trusted."""
    aw = ArrivalWait()
    for i in range(40):  # the last wave of a benchmark: nobody answers
        aw.finished(1, 100.0 + i * 0.01)
    aw.arrived(101.0)
    assert not aw.may_extend(0.0)
    aw.rest()
    assert aw.may_extend(0.0) and not aw.unanswered


@pytest.fixture
def core(tiny_hf_dir):
    from llmserve.runners.torch.runner import TorchRunner

    cfg = Config(block_size=4, max_seq_len=128, batch_size=8, block_bs=4, device="cpu")
    engine = LLMEngine(cfg, TorchRunner(str(tiny_hf_dir), cfg))
    ctx = zmq.Context()
    ours, theirs = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    ours.bind("inproc://core-arrivals")
    theirs.connect("inproc://core-arrivals")
    yield EngineCore(engine, ours), theirs
    ours.close(0)
    theirs.close(0)
    ctx.term()
    engine.shutdown()


def add(sock, req_id: str, arrival: float | None = None) -> None:
    """An add as the engine server sends it: `arrival` is when the server took it in (monotonic)."""
    params = {"max_tokens": 4, "temperature": 0.0}
    arrival = time.monotonic() if arrival is None else arrival
    sock.send(dumps({"op": "add", "req_id": req_id, "ids": [3, 5, 7], "params": params, "arrival": arrival}))


def test_it_takes_in_as_many_as_finished_then_stops_waiting(core):
    c, server = core
    since = time.monotonic()
    add(server, "a")
    add(server, "b")
    t = time.perf_counter()
    c._await_successors(finished=2, free=60.0, since=since)  # both are there: no need to wait the minute out
    assert time.perf_counter() - t < 30
    assert c.adds == 2 and c.engine.has_unfinished()
    since = time.monotonic()
    add(server, "c")
    c._await_successors(finished=1, free=60.0, since=since)
    assert c.adds == 3


def test_requests_that_came_before_the_finishes_do_not_end_the_wait(core):
    c, server = core
    since = time.monotonic()
    add(server, "late", arrival=since - 0.030)  # reached the server while the step ran: no successor
    t = time.perf_counter()
    c._await_successors(finished=1, free=0.3, since=since)  # so the wait goes on for the successor
    assert time.perf_counter() - t >= 0.25 and c.adds == 1 and c.arrivals.stats.by_arrivals == 0
    since = time.monotonic()
    add(server, "old", arrival=since - 0.030)
    add(server, "successor")
    c._await_successors(finished=1, free=60.0, since=since)
    assert c.adds == 3 and c.arrivals.stats.by_arrivals == 1


def test_it_stops_at_the_deadline_and_on_stop(core):
    c, server = core
    t = time.perf_counter()
    c._await_successors(finished=3, free=0.05, since=time.monotonic())  # nobody comes
    assert c.adds == 0 and time.perf_counter() - t < 30
    server.send(dumps({"op": "stop"}))
    c._await_successors(finished=3, free=60.0, since=time.monotonic())  # a stop ends the wait
    assert c.stopping


def test_past_the_free_part_the_idle_device_is_charged_to_the_budget(core):
    c, server = core  # no step in flight: the device is idle from the start of the extension
    t = time.perf_counter()
    c._await_successors(finished=1, free=0.0, since=time.monotonic())  # no free part; nobody comes
    took = time.perf_counter() - t
    stats = c.arrivals.stats
    assert stats.extended == 1 and stats.by_arrivals == 0
    # What is charged is the idle time inside this wait: some, and no more than the wait took. (Not "about CAP_S":
    # how far a poll overruns its timeout depends on the machine's load.) A hang guard: CAP_S is 50 ms.
    assert 0 < stats.idle_s <= took < 30
    assert c.arrivals.bucket == pytest.approx(BUCKET_S - stats.idle_s)
    c.arrivals.charge(c.arrivals.bucket)  # spent: the next wait ends with its free part
    c._await_successors(finished=1, free=0.0, since=time.monotonic())
    assert stats.extended == 1 and stats.by_arrivals == 0  # not extended: it ended with its free part


def test_step_times_are_kept_by_size():
    t = StepTimes()
    assert t.expect(64) is None
    t.observe(64, 0.010)
    t.observe(2048 + 64, 0.066)
    assert t.expect(100) == 0.010 and t.expect(2100) == 0.066  # same power-of-two class
    assert t.expect(1) is None
    t.observe(64, 0.020)
    assert 0.010 < t.expect(64) < 0.020  # a decayed mean


def test_the_step_in_flight_says_how_long_it_has_left(core):
    c, server = core
    eng = c.engine
    assert eng.step_left() == 0.0  # nothing in flight: nothing to overlap
    for i in range(3):
        add(server, f"r{i}")
    c._drain()
    lefts = []
    while eng.has_unfinished():
        eng.step()
        if eng.step_in_flight:
            lefts.append(eng.step_left())
    assert lefts[0] is None  # the prefill step's size had not been seen when it launched
    seen = [x for x in lefts if x is not None]
    assert seen and all(0.0 <= x < 5.0 for x in seen)


def test_the_core_forgets_unanswered_finishes_when_it_runs_out_of_work(core):
    import threading

    from llmserve.serving.ipc import loads

    c, server = core
    c.arrivals.answered = 0.0  # an earlier load's last wave went unanswered
    add(server, "a")
    loop = threading.Thread(target=c.serve, daemon=True)
    loop.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until "a" finished
        if server.poll(1000) and any(o[2] for o in loads(server.recv()).get("outs", [])):  # a finish reason
            break
    time.sleep(0.2)  # the loop finds no work left
    server.send(dumps({"op": "stop"}))
    loop.join(30)
    assert not loop.is_alive() and c.arrivals.answered == 1.0
