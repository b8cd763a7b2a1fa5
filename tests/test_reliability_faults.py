"""Faults injected into a running stack under HTTP load: the engine, the Triton Python-backend stub,
a uvicorn worker and the uvicorn parent are killed; then SIGTERM drains the service. Plus: an
unwritable LOG_DIR fails clearly at start.

Each fault: requests in flight end fast (an error, never a hang), the service returns to ready
and later requests succeed. (test_triton_stack.py covers the engine kill over gRPC without load.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from llmserve.serving.testing import ROOT, http_stack, process_tree

URL = "/v1/chat/completions"
FIGURES = {"faults": 0, "requests": 0, "failed_in_flight": 0, "unexpected": 0}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = http_stack(
        tmp_path_factory.mktemp("faults"),
        PUSH_MODE_HTTP_WORKERS=2,
        ADAPTER_INSTANCES=2,  # a killed stub beside a live one still restarts Triton
        MAX_SEQ_LEN=1024,
        MAX_DEC_LEN=512,
        BLOCK_BS=8,
        BATCH_SIZE=16,
        LLMSERVE_DRAIN_TIMEOUT=60,  # the drain test's 12 x 300 tokens take ~11 s on a 2-core machine
    )
    s.start()
    yield s
    print(f"\nfaults figures: {FIGURES}")
    s.stop()


def stream(stack, k: int, tag: str, timeout: float = 30) -> tuple[int, int, str, float]:
    """(status or error_code, tokens received, message, seconds) of one native stream."""
    t0 = time.monotonic()
    FIGURES["requests"] += 1
    body = {"text": f"fault {tag}", "max_dec_len": k, "min_dec_len": k, "stream": True}
    try:
        with requests.post(stack.http_base + URL, json=body, stream=True, timeout=timeout) as r:
            if r.status_code != 200:
                return r.status_code, 0, r.json().get("error_msg", r.text), time.monotonic() - t0
            lines = [json.loads(x) for x in r.iter_lines() if x]
    except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:  # a killed worker
        return -1, 0, str(e), time.monotonic() - t0
    n = sum(len(x.get("token_ids") or []) for x in lines)
    return lines[-1].get("error_code", 0), n, lines[-1].get("error_msg", ""), time.monotonic() - t0


def find(stack, word: str) -> list[int]:
    out = []
    for pid in process_tree(stack.supervisor_pid):
        try:
            if word in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                out.append(pid)
        except OSError:
            pass
    return out


def wait_all_ok(stack, timeout: float = 60) -> float:
    """Seconds until ready and a request through HTTP succeeds."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if stack.ready()[0] == 200:
            code, n, msg, _ = stream(stack, 4, "probe", timeout=10)
            if code == 0 and n == 4:
                return time.monotonic() - t0
        time.sleep(0.3)
    raise TimeoutError(f"not serving {timeout} s after the fault:\n{stack.logs()}")


def kill_under_load(stack, word: str, fail_fast_s: float) -> list[tuple]:
    """Start 8 long streams, kill the process whose command line holds `word`, return their results."""
    (victim,) = find(stack, word)[:1]
    with ThreadPoolExecutor(8) as pool:
        t_start = time.monotonic()
        futs = [pool.submit(stream, stack, 400, f"{word}-{i}") for i in range(8)]
        time.sleep(0.6)  # all running
        os.kill(victim, signal.SIGKILL)
        FIGURES["faults"] += 1
        t_kill = time.monotonic()
        results = [f.result(timeout=60) for f in futs]
    failed = [r for r in results if r[0] != 0]
    FIGURES["failed_in_flight"] += len(failed)
    # Nobody hangs: a stream the fault cut ends with its error fast. One that survives it runs to its
    # end at whatever pace the machine gives (11 s for 400 tokens once, beside another test process);
    # `f.result(timeout=60)` bounds those.
    slow = [r for r in failed if r[3] - (t_kill - t_start) > fail_fast_s]
    assert not slow, (slow, results)
    for code, n, msg, _ in results:  # each either finished whole or ended with a clear error
        assert (code == 0 and n == 400) or (code in (-1, 500, 503) and msg), (code, n, msg)
    return results


def test_engine_killed_mid_load_through_http(stack):
    results = kill_under_load(stack, "llmserve.serving.engine_process", fail_fast_s=5)
    assert any(r[0] == 500 for r in results), results
    code, _, msg, secs = stream(stack, 4, "while-down", timeout=10)  # fast 503 while it restarts
    assert (code == 503 and "not ready" in msg and secs < 2) or code == 0, (code, msg, secs)
    print(f"\nengine kill: back in {wait_all_ok(stack):.1f} s")
    with ThreadPoolExecutor(8) as pool:
        assert [r[:2] for r in pool.map(lambda i: stream(stack, 16, f"after-{i}"), range(16))] == [(0, 16)] * 16


def test_triton_stub_killed_mid_load(stack):
    """Triton does not restart a decoupled model's dead stub; the supervisor restarts Triton."""
    results = kill_under_load(stack, "triton_python_backend_stub", fail_fast_s=5)
    assert any(r[0] != 0 for r in results), results
    print(f"\nstub kill: back in {wait_all_ok(stack):.1f} s")
    log = (stack.log_dir / "server.log").read_text()
    # Either the supervisor saw the dead stub and restarted Triton, or Triton aborted on its own.
    assert "stub died: restarting tritonserver" in log or "tritonserver exited" in log, log
    with ThreadPoolExecutor(8) as pool:
        assert [r[:2] for r in pool.map(lambda i: stream(stack, 16, f"after-{i}"), range(16))] == [(0, 16)] * 16


def uvicorn_workers(stack) -> list[int]:
    return find(stack, "multiprocessing.spawn")


def test_frontend_worker_killed_is_replaced_by_uvicorn(stack):
    workers = uvicorn_workers(stack)
    assert len(workers) == 2, workers
    kill_under_load(stack, "multiprocessing.spawn", fail_fast_s=10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(set(uvicorn_workers(stack)) - set(workers)) < 1:
        time.sleep(0.2)
    now = uvicorn_workers(stack)
    assert len(now) == 2 and len(set(now) - set(workers)) == 1, (workers, now)
    wait_all_ok(stack)


def test_frontend_parent_killed_is_restarted_by_the_supervisor(stack):
    """Its workers die with it (PR_SET_PDEATHSIG), so the restarted front end can bind the port."""
    (parent,) = find(stack, "llmserve.http.server")
    workers = uvicorn_workers(stack)
    os.kill(parent, signal.SIGKILL)
    FIGURES["faults"] += 1
    t0 = time.monotonic()

    def gone(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] == "Z"
        except OSError:
            return True

    deadline = t0 + 10  # the orphaned workers got SIGTERM: a graceful stop takes up to 5 s
    while time.monotonic() < deadline and not all(gone(pid) for pid in workers):
        time.sleep(0.2)
    assert all(gone(pid) for pid in workers), workers
    # The supervisor's restarts (backing off while the old workers held the port) then get through.
    deadline = t0 + 40
    while time.monotonic() < deadline and not (
        find(stack, "llmserve.http.server") and len(uvicorn_workers(stack)) == 2
    ):
        time.sleep(0.2)
    (new_parent,) = find(stack, "llmserve.http.server")
    assert new_parent != parent and len(uvicorn_workers(stack)) == 2
    wait_all_ok(stack, timeout=20)
    print(f"\nfront-end parent kill: back in {time.monotonic() - t0:.1f} s")


def test_unwritable_log_dir_is_a_clear_error_at_start(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where LOG_DIR's parent should be")
    s = http_stack(tmp_path / "w")
    s.env["LOG_DIR"] = str(blocker / "log")
    t0 = time.monotonic()
    r = subprocess.run([str(ROOT / "start_server.sh")], env=s.env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"cannot write to LOG_DIR={blocker / 'log'}" in r.stderr and "Not a directory" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and time.monotonic() - t0 < 20
    # An existing LOG_DIR whose server.log cannot be opened (a directory in its place).
    log_dir = tmp_path / "log2"
    (log_dir / "server.log").mkdir(parents=True)
    s.env["LOG_DIR"] = str(log_dir)
    r = subprocess.run([str(ROOT / "start_server.sh")], env=s.env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot write to LOG_DIR" in r.stderr and "Is a directory" in r.stderr, r.stderr


def test_sigterm_drains_in_flight_and_refuses_new_with_503(stack):
    """Last: it stops the stack. SIGTERM to the supervisor (what stop_server.sh sends): requests in
    flight finish whole, new ones get 503 while they do, ready turns 500, then everything stops."""
    wait_all_ok(stack)
    k, n = 300, 12
    pid = stack.supervisor_pid
    with ThreadPoolExecutor(n) as pool:
        futs = [pool.submit(stream, stack, k, f"drain-{i}") for i in range(n)]
        time.sleep(0.6)
        os.kill(pid, signal.SIGTERM)
        FIGURES["faults"] += 1
        t0 = time.monotonic()
        new, ready_codes = [], set()
        while not all(f.done() for f in futs) and time.monotonic() - t0 < 20:
            sent = time.monotonic() - t0
            new.append((sent, stream(stack, 4, "new-during-drain", timeout=10)))
            ready_codes.add(stack.ready()[0])
            time.sleep(0.05)
        results = [f.result(timeout=30) for f in futs]
    drained = time.monotonic() - t0
    assert [r[:2] for r in results] == [(0, k)] * n, results  # every request in flight finished whole
    refused = [r for _, r in new if r[0] == 503 and "shutting down" in r[2]]
    assert refused, new
    for sent, (code, _, msg, _) in new:
        # 0.5 s for the signal to reach the engine; then 503 (or, once drained, connection refused).
        assert code in (503, -1) or sent < 0.5, (sent, code, msg)
    assert 500 in ready_codes
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and process_tree(pid):
        time.sleep(0.1)
    assert not process_tree(pid), "the supervisor did not stop"
    log = (stack.log_dir / "server.log").read_text()
    assert "draining" in log and "drained" in log, log
    r = stack.stop()  # what is left: the run file
    assert r.returncode == 0, r.stderr
    FIGURES["refused_while_draining"] = len(refused)
    print(f"\ndrain: {n} x {k} tokens finished in {drained:.1f} s; {len(refused)} new requests got 503")
