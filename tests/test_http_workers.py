"""The front end's workers (llmserve/http/workers.py), each with its own SO_REUSEPORT socket: a burst
of new connections spreads over them (uvicorn's shared socket gave one worker up to 193 of 256), a
worker that dies is replaced, a port in use is refused, and a stop leaves no process behind."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from llmserve.serving.testing import free_ports, process_tree

ROOT = Path(__file__).resolve().parents[1]
WORKERS = 4


def start(port: int) -> subprocess.Popen:
    code = (
        "import sys; from llmserve.http.workers import run_workers; "
        f"sys.exit(run_workers({WORKERS}, app='tests.http_pid_app:app', host='127.0.0.1', port={port}, "
        "log_level='info', timeout_graceful_shutdown=2))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def workers_of(proc: subprocess.Popen) -> list[int]:
    """The worker processes (multiprocessing's resource tracker is a child too)."""
    out = []
    for pid in process_tree(proc.pid):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            pass
    return out


async def burst(port: int, n: int) -> list[str]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one() -> str:
            async with s.get(f"http://127.0.0.1:{port}/") as r:
                return await r.text()

        return await asyncio.gather(*[one() for _ in range(n)])


def wait_serving(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if len(set(asyncio.run(burst(port, 64)))) == WORKERS:  # each gets some: 1 - 1e-8
                return
        except aiohttp.ClientError:
            pass
        time.sleep(0.2)
    raise AssertionError("the workers did not all serve")


@pytest.fixture
def front():
    (port,) = free_ports(1)
    proc = start(port)
    try:
        wait_serving(port)
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def test_a_burst_of_connections_spreads_over_the_workers(front):
    proc, port = front
    for _ in range(3):
        per_worker = collections.Counter(asyncio.run(burst(port, 256)))
        assert set(per_worker) == {str(p) for p in workers_of(proc)}
        # Evenly by a hash: 64 +- 7 each; one shared socket gave 117-193 to one worker.
        assert max(per_worker.values()) <= 100, per_worker


def test_a_dead_worker_is_replaced_and_a_stop_leaves_nothing(front):
    proc, port = front
    before = workers_of(proc)
    os.kill(before[0], signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (before[0] in workers_of(proc) or len(workers_of(proc)) < WORKERS):
        time.sleep(0.1)
    assert len(workers_of(proc)) == WORKERS and before[0] not in workers_of(proc)
    wait_serving(port)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert all(not Path(f"/proc/{p}").exists() for p in before[1:] + workers_of(proc))
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # the port is free again


def test_a_port_in_use_is_refused(front):
    _, port = front
    second = start(port)  # the same port while the first front end listens there
    out, _ = second.communicate(timeout=60)
    assert second.returncode == 1 and b"address is in use" in out
