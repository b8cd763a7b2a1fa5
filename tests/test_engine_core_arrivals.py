"""The engine core waits, while a step runs on the device, for the requests that replace those that
just finished (engine_core.arrival_wait): so they join the next step, as in-process ones do.

A real engine (the torch runner on the CPU, overlapped steps) and a real ZMQ PAIR link; the test is
the engine server's side of it."""

from __future__ import annotations

import time

import pytest
import zmq

from llmserve.config import Config
from llmserve.engine.llm_engine import LLMEngine
from llmserve.serving.engine_core import ARRIVAL_WAIT_S, EngineCore, arrival_wait
from llmserve.serving.ipc import dumps


def test_the_wait_is_short_and_only_while_a_step_runs():
    assert arrival_wait(0.080, finished=True, in_flight=True) == ARRIVAL_WAIT_S  # capped
    assert arrival_wait(0.008, finished=True, in_flight=True) == pytest.approx(0.004)  # half a step
    assert arrival_wait(0.040, finished=False, in_flight=True) == 0.0  # no one is about to come back
    assert arrival_wait(0.040, finished=True, in_flight=False) == 0.0  # the device would idle meanwhile


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


def add(sock, req_id: str) -> None:
    params = {"max_tokens": 4, "temperature": 0.0}
    sock.send(dumps({"op": "add", "req_id": req_id, "ids": [3, 5, 7], "params": params, "arrival": time.time()}))


def test_it_takes_in_as_many_as_finished_then_stops_waiting(core):
    c, server = core
    add(server, "a")
    add(server, "b")
    t = time.perf_counter()
    c._await_successors(finished=2, wait=60.0)  # both are there: no need to wait the minute out
    assert time.perf_counter() - t < 30
    assert c.adds == 2 and c.engine.has_unfinished()
    add(server, "c")
    c._await_successors(finished=1, wait=60.0)
    assert c.adds == 3


def test_it_stops_at_the_deadline_and_on_stop(core):
    c, server = core
    t = time.perf_counter()
    c._await_successors(finished=3, wait=0.05)  # nobody comes
    assert c.adds == 0 and time.perf_counter() - t < 30
    server.send(dumps({"op": "stop"}))
    c._await_successors(finished=3, wait=60.0)  # a stop ends the wait
    assert c.stopping
