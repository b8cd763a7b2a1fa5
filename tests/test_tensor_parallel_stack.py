"""Tensor parallelism through the whole stack on CPU (gloo): start_server.sh with MP_NUM=2, a worker
killed under load, and two "nodes" on loopback (127.0.0.1 and 127.0.0.2), each its own start_server.sh.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from llmserve.serving.testing import ROOT, ServingStack, free_ports, http_stack  # noqa: E402
from tests.test_reliability_faults import find, stream, wait_all_ok  # noqa: E402
from tests.test_tensor_parallel import llama_dir  # noqa: E402, F401  (fixture)

TP_ENV = dict(LLMSERVE_RUNNER="torch", LLMSERVE_DEVICE="cpu", MAX_SEQ_LEN=512, MAX_DEC_LEN=400, BLOCK_BS=8)
HEARTBEAT_TIMEOUT = 4  # s: a stopped worker is found out this long after it stopped


def test_stack_with_two_ranks_survives_a_killed_worker(tmp_path, llama_dir):  # noqa: F811
    stack = http_stack(
        tmp_path / "tp", MODEL_DIR=str(llama_dir), MP_NUM=2, DIST_HEARTBEAT_TIMEOUT=HEARTBEAT_TIMEOUT, **TP_ENV
    )
    stack.start()
    try:
        code, n, msg, _ = stream(stack, 8, "first")
        assert (code, n) == (0, 8), msg
        (worker,) = find(stack, "llmserve.executor.worker")
        assert find_all("llmserve.executor.worker", tmp_path) == [worker]  # find_all sees the stack's own workers
        with ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(stream, stack, 380, f"tp-{i}") for i in range(4)]
            time.sleep(1.0)  # all running
            os.kill(worker, signal.SIGKILL)
            t_kill = time.monotonic()
            results = [f.result(timeout=60) for f in futs]
        ended = time.monotonic() - t_kill
        assert ended < 10, (ended, results)  # the group's failure ends what was in flight at once
        for code, n, msg, _ in results:
            assert (code == 0 and n == 380) or (code in (-1, 500, 503) and msg), (code, n, msg)
        assert any(code != 0 for code, *_ in results), results
        back = wait_all_ok(stack, timeout=120)  # the supervisor restarted the whole group
        (new_worker,) = find(stack, "llmserve.executor.worker")
        assert new_worker != worker
        print(f"\nworker kill: requests ended {ended:.1f} s after it, serving again {back:.1f} s later")
        # A hung worker (stopped: no heartbeat, no progress) is found out and its group restarted too.
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(stream, stack, 380, "tp-hang")
            time.sleep(1.0)
            os.kill(new_worker, signal.SIGSTOP)
            t_stop = time.monotonic()
            code, n, msg, _ = fut.result(timeout=60)
        ended = time.monotonic() - t_stop
        assert code != 0 and msg and ended < HEARTBEAT_TIMEOUT + 10, (code, n, msg, ended)
        why = f"no heartbeat for {HEARTBEAT_TIMEOUT} s"
        assert any(why in f.read_text(errors="replace") for f in stack.log_dir.glob("*.log")), stack.logs()
        back = wait_all_ok(stack, timeout=120)
        assert find(stack, "llmserve.executor.worker") != [new_worker]
        print(f"worker hang: request ended {ended:.1f} s after it ({msg}), serving again {back:.1f} s later")
    finally:
        stack.stop()
    assert not find_all("llmserve.executor.worker", tmp_path)


def find_all(word: str, log_root: Path) -> list[int]:
    """Every process on the machine with `word` in its command line and a LOG_DIR under `log_root` (a
    stack's processes inherit it, however they were started; other tests' stacks have theirs)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if word not in open(f"/proc/{d}/cmdline", "rb").read().decode(errors="replace"):
                    continue
                env = open(f"/proc/{d}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            log_dirs = [Path(e[len(b"LOG_DIR=") :].decode(errors="replace")) for e in env if e.startswith(b"LOG_DIR=")]
            if log_dirs and log_dirs[0].is_relative_to(log_root):
                out.append(int(d))
    return out


def test_two_nodes_on_loopback_serve_through_node_0(tmp_path, llama_dir):  # noqa: F811
    (dist_port,) = free_ports(1)
    nodes = dict(MP_NUM=2, MP_NNODE=2, POD_IPS="127.0.0.1,127.0.0.2", DIST_PORT=dist_port, DIST_TIMEOUT=120)
    env1 = dict(os.environ, MODEL_DIR=str(llama_dir), NODE_RANK="1", LOG_DIR=str(tmp_path / "node1"), **TP_ENV)
    env1.update({k: str(v) for k, v in nodes.items()})
    env1 = {k: str(v) for k, v in env1.items()}
    r = subprocess.run([str(ROOT / "start_server.sh")], env=env1, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "ranks 1..1 of MP_NUM=2" in r.stdout and f"127.0.0.1:{dist_port}" in r.stdout
    node0 = http_stack(tmp_path / "node0", MODEL_DIR=str(llama_dir), NODE_RANK=0, **nodes, **TP_ENV)
    try:
        node0.start()
        code, n, msg, _ = stream(node0, 12, "two nodes")
        assert (code, n) == (0, 12), msg
        assert len(find_all("llmserve.executor.worker", tmp_path)) == 1  # rank 1, node 1's: node 0 starts none
    finally:
        node0.stop()
        r = subprocess.run([str(ROOT / "stop_server.sh")], env=env1, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 10
    while find_all("llmserve.executor", tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not find_all("llmserve.executor", tmp_path), "a node's launcher or worker outlived stop_server.sh"
    assert ServingStack  # (imported for type context)
