"""Set-up and Triton's side of the real stack (start_server.sh on free loopback ports, the demo model, the
HTTP front end), started twice in this module:

- every port the stack listens on is a setting, bound to its address (INTER_PROC_PORT, given here by its
  legacy alias INTER_QUEUE_PORT, and the engine's link to its core on 127.0.0.1 only); Triton's metrics
  are on TRITON_METRICS_PORT;
- the health port speaks KServe v2 to `tritonclient.http` (health, metadata, readable errors);
- a clean start logs no error-level line; the README's snippets run as written;
- a bad LLMSERVE_STOP_TIMEOUT is named (exit code 2) and the stack is stopped all the same; the next start
  moves the last one's logs aside.

(Refusals before anything starts are in test_triton_lifecycle.py; settings in test_config.py.)
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest

from llmserve.serving.control import _alive, rotate_logs
from llmserve.serving.testing import ROOT, ServingStack, http_stack, port_is_free, process_tree

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

# Error-level lines: glog's E/F lines (tritonserver, Paddle), Python logging's and uvicorn's ERROR/CRITICAL.
ERROR_LINE = re.compile(r"^[EF]\d{4} |\bERROR\b|\bCRITICAL\b|Traceback")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, demo_dir):
    s = http_stack(tmp_path_factory.mktemp("setup"), MAX_DEC_LEN=64)
    s.env["INTER_QUEUE_PORT"] = s.env.pop("INTER_PROC_PORT")  # the legacy alias: the engine must bind it
    s.start()
    yield s
    r = s.stop()
    assert r.returncode == 0, r.stderr


def error_lines(log_dir: Path) -> list[str]:
    return [
        f"{p.name}: {line}"
        for p in sorted(log_dir.glob("*.log"))
        for line in p.read_text(errors="replace").splitlines()
        if ERROR_LINE.search(line)
    ]


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntoa(raw[::-1])
    ip = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
    return str(ip.ipv4_mapped or ip)


def listening_sockets(root: int) -> list[tuple[str, int, str]]:
    """(address, port, process command line) of every listening TCP socket of `root`'s process tree."""
    by_inode = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":  # LISTEN
                addr, port = f[1].split(":")
                by_inode[f[9]] = (_address(addr), int(port, 16))
    found = set()
    for pid in process_tree(root):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            inode = target[len("socket:[") : -1] if target.startswith("socket:[") else None
            if inode in by_inode:
                found.add((*by_inode[inode], cmd))
    return sorted(found)


def test_a_clean_start_logs_no_error_line(stack):
    names = {p.name for p in stack.log_dir.glob("*.log")}
    assert {"server.log", "engine.log", "triton.log", "http.log"} <= names, names
    assert error_lines(stack.log_dir) == []
    # The engine core froze what it loaded (engine/heap.py): a model's worth of objects, not a handful.
    frozen = re.search(r"(\d+) startup objects frozen", (stack.log_dir / "engine.log").read_text())
    assert frozen and int(frozen.group(1)) > 10_000
    triton_log = (stack.log_dir / "triton.log").read_text()
    assert "Started GRPCInferenceService" in triton_log
    # Without libcuda.so (a CPU machine), Triton's harmless CUDA block-manager error is a warning, saying why.
    for line in triton_log.splitlines():
        if "CudaDriverHelper" in line:
            assert line.startswith("W") and "llmserve: no CUDA driver library" in line, line


def test_every_listening_port_is_a_setting_bound_to_its_address(stack):
    inter = int(stack.env["INTER_QUEUE_PORT"])
    expected = {
        stack.ports["HEALTH_HTTP_PORT"]: "llmserve.serving.supervisor",
        stack.ports["METRICS_HTTP_PORT"]: "llmserve.serving.supervisor",
        stack.ports["SERVICE_GRPC_PORT"]: "tritonserver",
        stack.ports["TRITON_METRICS_PORT"]: "tritonserver",
        stack.ports["SERVICE_HTTP_PORT"]: "llmserve.http",
        inter: "llmserve.serving.engine_process",
    }
    socks = listening_sockets(stack.supervisor_pid)
    seen = {}
    core_links = []
    for addr, port, cmd in socks:
        # LLMSERVE_HOST is 127.0.0.1 here, and INTER_PROC_PORT is 127.0.0.1 whatever it says.
        assert addr == "127.0.0.1", (addr, port, cmd)
        if port in expected:
            assert expected[port] in cmd, (port, cmd)
            seen[port] = cmd
        else:  # only the engine server's link to its own core process, on a port the OS picked
            assert "llmserve.serving.engine_process" in cmd, (addr, port, cmd)
            core_links.append(port)
    assert set(seen) == set(expected), f"not listening: {set(expected) - set(seen)}"
    assert len(core_links) == 1, socks
    # TRITON_METRICS_PORT is Triton's own metrics endpoint, and METRICS_HTTP_PORT re-exports it.
    status, text = stack._get("TRITON_METRICS_PORT", "/metrics")
    assert status == 200 and 'nv_inference_request_success{model="model",version="1"}' in text
    deadline = time.monotonic() + 10
    while "nv_inference_request_success" not in stack._get("METRICS_HTTP_PORT", "/metrics")[1]:
        assert time.monotonic() < deadline, "Triton's metrics are not re-exported on METRICS_HTTP_PORT"
        time.sleep(0.2)


def test_tritonclient_http_speaks_to_the_health_port(stack):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{stack.ports['HEALTH_HTTP_PORT']}")
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("model") and client.is_model_ready("model", "1")
        assert not client.is_model_ready("nope") and not client.is_model_ready("model", "2")
        meta = client.get_server_metadata()
        assert meta["name"] == "llmserve" and meta["version"] and meta["extensions"] == []
        model = client.get_model_metadata("model")
        assert model == client.get_model_metadata("model", "1")
        assert (model["name"], model["versions"], model["platform"]) == ("model", ["1"], "python")
        assert model["inputs"] == [{"name": "IN", "datatype": "BYTES", "shape": [1]}]
        assert model["outputs"] == [{"name": "OUT", "datatype": "BYTES", "shape": [1]}]
        with pytest.raises(InferenceServerException) as e:
            client.get_model_metadata("nope")
        assert e.value.status() == "404" and "unknown model: 'nope'" in e.value.message()
        with pytest.raises(InferenceServerException) as e:
            client.get_model_metadata("model", "7")
        assert e.value.status() == "404" and "version 7" in e.value.message()
        with pytest.raises(InferenceServerException) as e:  # inference is not served here: a clear 405
            client.infer("model", [httpclient.InferInput("IN", [1], "BYTES").set_data_from_numpy(_json_in({}))])
        assert e.value.status() == "405" and "SERVICE_GRPC_PORT" in e.value.message()
    finally:
        client.close()
    # Any other path: 404 with KServe's error body.
    status, body = stack._get("HEALTH_HTTP_PORT", "/v2/repository/index")
    assert status == 404 and "not found: /v2/repository/index" in json.loads(body)["error"]


def test_a_client_that_hangs_up_before_its_answer_leaves_no_traceback(stack):
    """A probe client that gives up (its timeout, on a busy machine) and resets the connection: the
    health and metrics ports' answer meets a broken pipe. Nobody is left to tell; the log stays clean."""
    for var, path in (("HEALTH_HTTP_PORT", "/v2/health/ready"), ("METRICS_HTTP_PORT", "/metrics")):
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", stack.ports[var])) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close: RST
                sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert stack._get(var, path)[0] == 200
    time.sleep(0.3)  # the server threads' last writes
    assert error_lines(stack.log_dir) == []


def _json_in(obj: dict):
    import numpy as np

    return np.array([json.dumps(obj).encode()], dtype=np.object_)


def test_readme_snippets_run_as_written(stack):
    readme = (ROOT / "README.md").read_text()
    block = readme.split("Once `make serve` prints the endpoints", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert ".venv/bin/python - <<'PY'" in block and "curl" in block
    for default, var in (("9965", "SERVICE_HTTP_PORT"), ("8110", "HEALTH_HTTP_PORT"), ("8722", "METRICS_HTTP_PORT")):
        assert f"127.0.0.1:{default}" in block
        block = block.replace(f"127.0.0.1:{default}", f"127.0.0.1:{stack.ports[var]}")
    # As a user would run it: from the repository, no virtual environment active.
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if ".venv" not in p)
    r = subprocess.run(["bash", "-e", "-c", block], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    first, end = json.JSONDecoder().raw_decode(r.stdout)  # curl's answer ends with no newline
    rest = r.stdout[end:]
    assert first["error_code"] == 0 and first["result"]
    assert '{"status": "ready"}' in rest and re.search(r"^(\{.*\})?llmserve_requests_running ", rest, re.M), r.stdout


def test_rotate_logs_keeps_five_generations(tmp_path):
    (tmp_path / "server.log").mkdir()  # not a file: left alone (start then reports it as unwritable)
    for start in range(7):
        (tmp_path / "engine.log").write_text(f"start {start}\n")
        rotate_logs(tmp_path)
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["engine.log.1", "engine.log.2", "engine.log.3", "engine.log.4", "engine.log.5", "server.log"]
    assert [(tmp_path / f"engine.log.{i}").read_text() for i in range(1, 6)] == [
        f"start {s}\n" for s in (6, 5, 4, 3, 2)
    ]


def test_bad_stop_timeout_still_stops_all_and_the_next_start_rotates_logs(stack: ServingStack):
    """Last: it stops the stack, then starts it again."""
    pid = stack.supervisor_pid
    tree = process_tree(pid)
    assert len(tree) >= 5, tree  # supervisor, engine server + core, tritonserver (+ its stub), front end
    first_logs = {name: (stack.log_dir / name).read_text() for name in ("engine.log", "triton.log", "server.log")}
    r = subprocess.run(
        [str(ROOT / "stop_server.sh")], env={**stack.env, "LLMSERVE_STOP_TIMEOUT": "30s"}, capture_output=True,
        text=True, timeout=90,
    )  # fmt: skip
    assert r.returncode == 2, (r.stdout, r.stderr)
    (line,) = r.stderr.splitlines()
    assert line.startswith("stop_server: invalid settings: LLMSERVE_STOP_TIMEOUT='30s'"), line
    assert f"llmserve stopped (pid {pid})" in r.stdout
    assert [p for p in tree if _alive(p)] == []
    for var, port in stack.ports.items():
        assert port_is_free(port), f"{var}={port} still taken"

    # The next start: while it comes up, the health port already answers, in KServe's shape.
    proc = subprocess.Popen([str(ROOT / "start_server.sh")], env=stack.env, stdout=subprocess.PIPE, text=True)
    seen_not_ready = None
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            status, body = stack.ready()
        except OSError:  # not listening yet
            status, body = 0, ""
        if status == 500 and seen_not_ready is None:
            seen_not_ready = json.loads(body)
        time.sleep(0.1)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "ready" in out, out
    # The engine takes seconds to load, the health port answers at once: not ready, in both shapes.
    assert seen_not_ready is not None, "the health port never answered 500 during start-up"
    assert seen_not_ready["error_code"] == 1 and seen_not_ready["error"] == seen_not_ready["error_msg"] != ""
    # Each start's logs stand alone: the last start's moved to *.log.1, whole.
    for name, text in first_logs.items():
        assert (stack.log_dir / f"{name}.1").read_text().startswith(text), name
        assert not (stack.log_dir / name).read_text().startswith(text[:200]), name
    assert "started engine" in (stack.log_dir / "server.log").read_text()
    assert error_lines(stack.log_dir) == []
