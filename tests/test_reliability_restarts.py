"""start -> load -> stop, several times on the same ports: each start is ready, the load succeeds,
and each stop leaves nothing behind (processes, ports, /dev/shm regions, run/lock files).

10 cycles by default, as the issue asks (LLMSERVE_RELIABILITY_CYCLES to change).
(test_triton_lifecycle.py does 3 cycles without load, over gRPC only, with the legacy port names.)
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from llmserve.serving.control import _group_members
from llmserve.serving.testing import http_stack, port_is_free

CYCLES = int(os.environ.get("LLMSERVE_RELIABILITY_CYCLES", "10"))
LOAD = 48  # requests per cycle, 8 at a time


def shm() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir()}


def one(base: str, i: int) -> int:
    if i % 2:
        body = {"text": f"cycle load {i}", "max_dec_len": 8, "min_dec_len": 8, "stream": bool(i % 4 == 1)}
        with requests.post(base + "/v1/chat/completions", json=body, timeout=30, stream=True) as r:
            assert r.status_code == 200, r.text
            text = r.text
        assert '"error_code": 0' in text.replace('"error_code":0', '"error_code": 0'), text[-300:]
        return 8
    body = {"model": "default", "prompt": f"cycle load {i}", "max_tokens": 8}
    r = requests.post(base + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["completion_tokens"]


@pytest.mark.serial  # its /dev/shm check sees every process's regions
def test_start_load_stop_cycles_leave_nothing_behind(tmp_path):
    stack = http_stack(tmp_path, PUSH_MODE_HTTP_WORKERS=2, MAX_SEQ_LEN=1024, MAX_DEC_LEN=64, BLOCK_BS=8)
    shm_before = shm()
    figures = []
    for cycle in range(CYCLES):
        t0 = time.monotonic()
        r = stack.start()
        started = time.monotonic() - t0
        assert "ready" in r.stdout and stack.ready()[0] == 200, r.stdout
        pid = stack.supervisor_pid
        with ThreadPoolExecutor(8) as pool:
            tokens = list(pool.map(lambda i: one(stack.http_base, i), range(LOAD)))
        assert all(1 <= n <= 8 for n in tokens)
        t1 = time.monotonic()
        r = stack.stop()
        stopped = time.monotonic() - t1
        assert r.returncode == 0 and "stopped" in r.stdout, r.stderr
        # Nothing left behind.
        assert not _group_members(pid), f"cycle {cycle}: processes left: {_group_members(pid)}"
        for var, port in stack.ports.items():
            assert port_is_free(port), f"cycle {cycle}: {var}={port} still taken"
        assert shm() - shm_before == set(), f"cycle {cycle}: /dev/shm left: {shm() - shm_before}"
        # Only logs (this start's, and the earlier starts' moved aside: x.log.1 ...).
        left = sorted(p.name for p in stack.log_dir.iterdir() if not re.fullmatch(r".+\.log(\.\d+)?", p.name))
        assert left == [], f"cycle {cycle}: files left in LOG_DIR: {left}"
        figures.append((round(started, 1), round(stopped, 1)))
        assert started < 60 and stopped < 30
    print(f"\n{CYCLES} cycles x {LOAD} requests; (start s, stop s): {figures}")
