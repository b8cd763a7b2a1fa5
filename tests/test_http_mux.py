"""The HTTP front end's requests share one gRPC stream per worker (http/triton_client.py): clients that
hang up are aborted through it, whichever Triton model instance holds their request, and nothing stays
behind in the front end, the stubs or the engine. Real stack: 2 model instances, 1 HTTP worker."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest

from llmserve.http.triton_client import TritonBackend
from llmserve.serving.testing import http_stack, record
from llmserve.utils.wire import dumps

URL = "/v1/chat/completions"
LONG = 2000  # tokens: far longer than any abort takes


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = http_stack(
        tmp_path_factory.mktemp("mux"),
        PUSH_MODE_HTTP_WORKERS=1,
        ADAPTER_INSTANCES=2,
        BATCH_SIZE=16,
        MAX_SEQ_LEN=4096,
        MAX_DEC_LEN=LONG,
        BLOCK_BS=8,
    )
    s.start()
    try:
        yield s
    finally:
        s.stop()


def gauge(stack, name: str) -> float:
    return sum(v for k, v in stack.metrics().items() if k.split("{")[0] == name)


def wait_gauge(stack, name: str, pred, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    while not pred(v := gauge(stack, name)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return v


def idle(stack) -> None:
    assert wait_gauge(stack, "llmserve_kv_blocks_used", lambda v: v == 0) == 0
    assert wait_gauge(stack, "llmserve_requests_running", lambda v: v == 0) == 0
    time.sleep(0.6)  # the counters reach the supervisor within one heartbeat


def body(i: int, n: int = LONG, stream: bool = True) -> dict:
    return {"text": f"mux {i}", "max_dec_len": n, "min_dec_len": n, "stream": stream}


async def hang_up_after(client: httpx.AsyncClient, i: int, lines: int) -> int:
    """Read `lines` lines of a long stream, then hang up; the error_code of the last line read."""
    async with client.stream("POST", URL, json=body(i)) as r:
        assert r.status_code == 200
        got = 0
        async for line in r.aiter_lines():
            if line:
                got += 1
                code = json.loads(line)["error_code"]
                if got == lines:
                    return code
    raise AssertionError("the stream ended early")


def test_clients_that_hang_up_are_aborted_on_every_instance(stack):
    """16 long streams at once (spread over both instances by Triton, their aborts too), each client
    gone after 2 lines: all 16 aborted within seconds, no tokens run on, and the stack then serves."""
    idle(stack)
    before = {k: gauge(stack, k) for k in ("llmserve_request_cancelled_total", "llmserve_request_success_total")}

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=stack.http_base, timeout=60) as client:
            return await asyncio.gather(*[hang_up_after(client, i, 2) for i in range(16)])

    assert asyncio.run(burst()) == [0] * 16
    t0 = time.monotonic()
    idle(stack)
    assert time.monotonic() - t0 < 6
    assert gauge(stack, "llmserve_request_cancelled_total") - before["llmserve_request_cancelled_total"] == 16
    assert gauge(stack, "llmserve_request_success_total") == before["llmserve_request_success_total"]

    async def served() -> list[int]:
        async with httpx.AsyncClient(base_url=stack.http_base, timeout=60) as client:
            rs = await asyncio.gather(*[client.post(URL, json=body(i, 8, stream=False)) for i in range(16)])
        return [len(r.json()["token_ids"]) for r in rs]

    assert asyncio.run(served()) == [8] * 16


def test_the_shared_stream_forgets_every_request(stack):
    """Our client on its own (the front end's TritonBackend): requests that end, that are left early, and
    one whose abort came before the request reached the engine (staged: the abort of an unknown req_id
    does nothing, so the request's next response must abort it again) all end, and the stream keeps no
    route and no abandoned request."""
    idle(stack)

    async def run() -> tuple[dict, dict, list]:
        backend = TritonBackend(stack.grpc_url)
        try:
            ends = []
            for i in range(4):  # run to their end
                async with contextlib.aclosing(backend.stream(record({**body(i, 4), "req_id": f"end-{i}"}))) as gen:
                    ends.append([item async for item in gen][-1]["is_end"])
            for i in range(6):  # left after their first item
                async with contextlib.aclosing(backend.stream(record({**body(i), "req_id": f"left-{i}"}))) as gen:
                    assert (await anext(gen))["error_code"] == 0
            mux = backend._stream_mux()
            mux._abort("early")  # the engine knows no "early" yet: nothing happens
            raw = dumps(record({**body(0), "req_id": "early"}))
            tid, _ = mux.open(raw, "early")
            mux.routes.pop(tid)  # the reader left, its abort (above) already sent
            mux.abandoned[tid] = "early"
            deadline = time.monotonic() + 10
            while (mux.routes or mux.abandoned) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return dict(mux.routes), dict(mux.abandoned), ends
        finally:
            await backend.close()

    routes, abandoned, ends = asyncio.run(run())
    assert ends == [1] * 4
    assert routes == {} and abandoned == {}
    idle(stack)
