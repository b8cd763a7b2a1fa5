"""start_server.sh / stop_server.sh: clear start-up errors (bad settings, taken or clashing
ports, an address that is not ours: named, exit code 2, nothing started), clean start/stop
cycles, the queue bound (429), DISABLE_STREAMING and USE_WARMUP."""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path

import pytest

from llmserve.serving.control import _group_members
from llmserve.serving.testing import PORT_VARS, ServingStack, port_is_free

pytest.importorskip("tritonclient.grpc")
from llmserve.triton.client import TritonStream, collect  # noqa: E402

# Ten cycles in a row, under load, with the HTTP front end: test_reliability_restarts.py. These
# three check the gRPC-only stack and the legacy port names.
CYCLES = int(os.environ.get("LLMSERVE_TEST_CYCLES", "3"))
ALL_PORT_VARS = PORT_VARS


def new_stack(work_dir: Path, **env) -> ServingStack:
    """A ServingStack: every port a free one, Triton's metrics port included (its default, 8002, would
    clash with any other stack on this machine)."""
    return ServingStack(work_dir, **env)


def assert_nothing_started(stack: ServingStack) -> None:
    assert not (stack.log_dir / "llmserve.run.json").exists()
    assert not (stack.log_dir / "server.log").exists()
    for var, port in stack.ports.items():
        assert port_is_free(port), f"{var}={port} is taken"


def assert_nothing_left(stack: ServingStack, pid: int) -> None:
    assert not _group_members(pid), f"processes left: {_group_members(pid)}"
    for var, port in stack.ports.items():
        assert port_is_free(port), f"{var}={port} still taken"
    grpc = stack.ports["SERVICE_GRPC_PORT"]
    assert not list(Path("/dev/shm").glob(f"llmserve_{grpc}_*"))
    assert not (stack.log_dir / "llmserve.run.json").exists()


@pytest.mark.parametrize("var", [*PORT_VARS[:4], "TRITON_METRICS_PORT"])
def test_taken_port_is_named_before_anything_starts(tmp_path, var):
    stack = new_stack(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", stack.ports[var]))
        s.listen()
        r = stack.start(check=False)
    assert r.returncode == 2
    assert f"port {stack.ports[var]} ({var}) is already in use" in r.stderr, r.stderr
    assert not (stack.log_dir / "llmserve.run.json").exists()
    assert not (stack.log_dir / "server.log").exists()  # nothing was started


def test_two_settings_on_one_port_are_named(tmp_path):
    stack = new_stack(tmp_path)
    stack.env["TRITON_METRICS_PORT"] = stack.env["HEALTH_HTTP_PORT"]
    r = stack.start(check=False)
    assert r.returncode == 2
    assert f"TRITON_METRICS_PORT={stack.ports['HEALTH_HTTP_PORT']} is the same port as HEALTH_HTTP_PORT" in r.stderr
    assert_nothing_started(stack)


def test_host_that_is_not_ours_is_named(tmp_path):
    stack = new_stack(tmp_path, LLMSERVE_HOST="192.0.2.1")  # TEST-NET-1: never an address of this machine
    r = stack.start(check=False)
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "start_server: LLMSERVE_HOST='192.0.2.1' is not an address of this machine (Cannot assign requested address)"
    )
    assert_nothing_started(stack)


@pytest.mark.parametrize("value", ["60s", "0", "-5", "nan"])
def test_bad_start_timeout_is_named_and_starts_nothing(tmp_path, value):
    stack = new_stack(tmp_path, LLMSERVE_START_TIMEOUT=value)
    stack.log_dir.mkdir(parents=True)
    (stack.log_dir / "engine.log").write_text("the last start's log\n")
    r = stack.start(check=False)
    assert r.returncode == 2, (r.stdout, r.stderr)
    (line,) = r.stderr.splitlines()  # one message, no traceback
    assert line.startswith("start_server: invalid settings: LLMSERVE_START_TIMEOUT") and value in line, line
    assert_nothing_started(stack)
    # Nothing was touched either: the last start's logs were not moved aside.
    assert (stack.log_dir / "engine.log").read_text() == "the last start's log\n"
    assert not (stack.log_dir / "engine.log.1").exists()


def test_bad_setting_is_named_before_a_download(tmp_path):
    r = new_stack(tmp_path, BATCH_SIZE="many", MODEL_DIR=tmp_path / "models").start("org/model", check=False)
    assert r.returncode == 2
    assert "BATCH_SIZE='many'" in r.stderr and "downloading" not in r.stdout, (r.stdout, r.stderr)
    assert not (tmp_path / "models").exists()


def test_bad_setting_is_named(tmp_path):
    r = new_stack(tmp_path, BATCH_SIZE="many", BLOCK_RATIO="2").start(check=False)
    assert r.returncode == 2
    assert "BATCH_SIZE='many'" in r.stderr and "BLOCK_RATIO='2'" in r.stderr


def test_start_stop_cycles_leave_nothing_behind(tmp_path, demo_dir):
    stack = new_stack(tmp_path, MODEL_DIR=demo_dir)
    # Legacy names must work as well as the new ones.
    legacy = {"HEALTH_HTTP_PORT": "HTTP_PORT", "SERVICE_GRPC_PORT": "GRPC_PORT", "METRICS_HTTP_PORT": "METRICS_PORT"}
    for new, old in legacy.items():
        stack.env[old] = stack.env.pop(new)
    for i in range(CYCLES):
        t0 = time.monotonic()
        r = stack.start()
        assert "ready" in r.stdout and stack.grpc_url in r.stdout, r.stdout
        pid = stack.supervisor_pid
        assert stack.ready()[0] == 200
        c = TritonStream(stack.grpc_url)
        msgs = collect(c.submit({"text": f"cycle {i}", "max_dec_len": 4}))
        c.close()
        assert msgs[-1]["error_code"] == 0
        r = stack.stop()
        assert r.returncode == 0 and "stopped" in r.stdout, r.stderr
        assert time.monotonic() - t0 < 60
        assert_nothing_left(stack, pid)
    assert "stop_server: no server running" in stack.stop().stdout


def test_queue_bound_disable_streaming_and_warmup(tmp_path, demo_dir):
    env = {"MODEL_DIR": demo_dir, "BATCH_SIZE": 1, "MAX_CACHED_TASK_NUM": 2, "DISABLE_STREAMING": 1, "USE_WARMUP": 1}
    with new_stack(tmp_path, **env) as stack:
        assert "warm" in (stack.log_dir / "engine.log").read_text()
        c = TritonStream(stack.grpc_url)
        n = 8
        qs = [
            c.submit({"text": f"request {i}", "max_dec_len": 200, "min_dec_len": 200, "return_usage": True})
            for i in range(n)
        ]
        results = [collect(q) for q in qs]
        c.close()
        codes = [r[-1]["error_code"] for r in results]
        # One runs (BATCH_SIZE=1), two may wait: the rest are turned away.
        assert codes.count(429) >= n - 3 and codes.count(0) >= 1, codes
        for r in results:
            if r[-1]["error_code"] == 0:
                (only,) = r  # DISABLE_STREAMING: the whole result in one message
                assert len(only["token_ids"]) == only["usage"]["completion_tokens"] == 200
                assert only["token"] == only["tokens_all"]
            else:
                assert "MAX_CACHED_TASK_NUM" in r[-1]["error_msg"]
        time.sleep(1.2)
        assert stack.metrics()['llmserve_request_failure_total{error_code="429"}'] == codes.count(429)


def test_start_with_model_name_downloads_then_serves_with_console_logs(tmp_path, demo_dir):
    """`start_server.sh <model_name>`: download_model.py from MODEL_BASE_URL into MODEL_DIR, then serve."""
    import functools
    import hashlib
    import shutil
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    name = f"test-org/demo-{random.randrange(1000)}/bf16"
    published = tmp_path / "www" / name
    shutil.copytree(demo_dir, published)
    files = sorted(p for p in published.rglob("*") if p.is_file())
    lines = [f"{p.relative_to(published)}:{hashlib.md5(p.read_bytes()).hexdigest()}" for p in files]
    (published / "file_list.txt").write_text("\n".join(lines) + "\n")

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp_path / "www")))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    models = tmp_path / "models"
    stack = new_stack(
        tmp_path / "run",
        MODEL_DIR=models,
        MODEL_BASE_URL=f"http://127.0.0.1:{httpd.server_address[1]}",
        OUTPUT_LOG_TO_CONSOLE=1,
    )
    try:
        r = stack.start(name)
        assert "downloaded" in r.stdout and "ready" in r.stdout, r.stdout
        for p in files:
            assert (models / p.relative_to(published)).read_bytes() == p.read_bytes()
        c = TritonStream(stack.grpc_url)
        assert collect(c.submit({"text": "hello", "max_dec_len": 3}))[-1]["error_code"] == 0
        c.close()
        # Console logging: the engine and Triton log to start_server's stdout, nothing to LOG_DIR.
        out = (stack.work_dir / "start.out").read_text()
        assert "engine serving on" in out and "Started GRPCInferenceService" in out
        assert not list(stack.log_dir.glob("*.log"))
    finally:
        stack.stop()
        httpd.shutdown()
        httpd.server_close()
