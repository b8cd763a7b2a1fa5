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

import requests

from llmserve.serving.control import _group_members
from llmserve.serving.testing import http_stack, port_is_free, process_tree

CYCLES = int(os.environ.get("LLMSERVE_RELIABILITY_CYCLES", "10"))
LOAD = 48  # requests per cycle, 8 at a time


def shm_of(stack) -> set[str]:
    """The /dev/shm entries the running stack has: Triton's Python-backend regions (named by its gRPC
    port, serving/tritonserver.py) and whatever else its processes map. Not all of /dev/shm: the other
    test process's stacks come and go beside this one."""
    names = {p.name for p in Path("/dev/shm").glob(f"llmserve_{stack.ports['SERVICE_GRPC_PORT']}_*")}
    for pid in process_tree(stack.supervisor_pid):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # gone
            continue
        names |= {
            line.split("/dev/shm/", 1)[1]
            for line in maps.splitlines()
            if "/dev/shm/" in line and not line.endswith(" (deleted)")  # unlinked: nothing to leave
        }
    return names


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


def test_start_load_stop_cycles_leave_nothing_behind(tmp_path):
    stack = http_stack(tmp_path, PUSH_MODE_HTTP_WORKERS=2, MAX_SEQ_LEN=1024, MAX_DEC_LEN=64, BLOCK_BS=8)
    grpc = stack.ports["SERVICE_GRPC_PORT"]
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
        regions = shm_of(stack)
        assert any(name.startswith(f"llmserve_{grpc}_") for name in regions), regions  # the check sees them
        t1 = time.monotonic()
        r = stack.stop()
        stopped = time.monotonic() - t1
        assert r.returncode == 0 and "stopped" in r.stdout, r.stderr
        # Nothing left behind.
        assert not _group_members(pid), f"cycle {cycle}: processes left: {_group_members(pid)}"
        for var, port in stack.ports.items():
            assert port_is_free(port), f"cycle {cycle}: {var}={port} still taken"
        left = {name for name in regions if Path("/dev/shm", name).exists()}
        left |= {p.name for p in Path("/dev/shm").glob(f"llmserve_{grpc}_*")}
        assert not left, f"cycle {cycle}: /dev/shm left: {left}"
        # Only logs (this start's, and the earlier starts' moved aside: x.log.1 ...).
        left = sorted(p.name for p in stack.log_dir.iterdir() if not re.fullmatch(r".+\.log(\.\d+)?", p.name))
        assert left == [], f"cycle {cycle}: files left in LOG_DIR: {left}"
        figures.append((round(started, 1), round(stopped, 1)))
        assert started < 60 and stopped < 30
    print(f"\n{CYCLES} cycles x {LOAD} requests; (start s, stop s): {figures}")
