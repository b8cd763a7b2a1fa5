"""`start` and `stop` behind start_server.sh / stop_server.sh.

start: validate every setting and check every port *before* anything starts,
move the last start's logs aside (LOG_DIR/engine.log -> engine.log.1 ...),
launch the supervisor in its own session (logs under LOG_DIR, or the console
with OUTPUT_LOG_TO_CONSOLE=1), wait until /v2/health/ready answers 200 (up to
LLMSERVE_START_TIMEOUT), print the endpoints. stop: SIGTERM the supervisor, wait
(LLMSERVE_STOP_TIMEOUT, default 30 s), then kill what is left of its process
group and remove its /dev/shm regions. The run file LOG_DIR/llmserve.run.json
ties the two together.

A bad setting is one line naming each bad variable and exit code 2: start then
starts nothing; stop still stops the stack (with the defaults in place of what
it cannot read), since that is what its caller wants done.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from llmserve.config import Config, ConfigError
from llmserve.runners.rank_layout import layout
from llmserve.serving import start_status
from llmserve.serving.ports import bind_error
from llmserve.serving.start_status import LOAD_FAILED
from llmserve.serving.supervisor import http_frontend_enabled
from llmserve.serving.tritonserver import TritonNotFound, pytriton_root, shm_prefix

RUN_FILE = "llmserve.run.json"
LOG_GENERATIONS = 5  # a start keeps the logs of this many earlier starts: engine.log.1 (the last) .. engine.log.5


def stack_ports(cfg: Config) -> dict[str, tuple[int, str]]:
    """Every port the stack listens on: variable -> (port, address it binds). The engine IPC port is
    loopback only; the engine's link to its core process is an ephemeral loopback port the OS picks."""
    ports = {
        "HEALTH_HTTP_PORT": (cfg.health_http_port, cfg.host),
        "SERVICE_GRPC_PORT": (cfg.service_grpc_port, cfg.host),
        "METRICS_HTTP_PORT": (cfg.metrics_http_port, cfg.host),
        "INTER_PROC_PORT": (cfg.inter_proc_port, "127.0.0.1"),
    }
    if cfg.triton_metrics_port != -1:
        ports["TRITON_METRICS_PORT"] = (cfg.triton_metrics_port, cfg.host)
    if http_frontend_enabled(cfg):
        ports["SERVICE_HTTP_PORT"] = (cfg.service_http_port, cfg.host)
    if cfg.mp_num > 1:  # rank 0's rendezvous store
        ports["DIST_PORT"] = (cfg.dist_port, cfg.pod_0_ip or (cfg.node_ips or ["127.0.0.1"])[0])
    return ports


def port_problems(cfg: Config) -> list[str]:
    """One message per port that is taken, set twice or cannot be bound, naming its variable."""
    problems: list[str] = []
    seen: dict[int, str] = {}
    for name, (port, host) in stack_ports(cfg).items():
        if port == -1:
            problems.append(f"{name}=-1: this port cannot be turned off")
            continue
        if port in seen:
            problems.append(f"{name}={port} is the same port as {seen[port]}")
            continue
        seen[port] = name
        e = bind_error(host, port)
        if isinstance(e, socket.gaierror):
            problems.append(f"LLMSERVE_HOST={host!r} is not an address of this machine ({e.strerror})")
            break  # every other port would say the same
        if e is not None:
            if e.errno == errno.EADDRINUSE:
                problems.append(f"port {port} ({name}) is already in use on {host}: {e.strerror}")
            elif e.errno == errno.EADDRNOTAVAIL and host == cfg.host:
                problems.append(f"LLMSERVE_HOST={host!r} is not an address of this machine ({e.strerror})")
                break
            else:
                problems.append(f"port {port} ({name}) cannot be bound on {host}: {e.strerror}")
    return problems


def rotate_logs(log_dir: Path, keep: int = LOG_GENERATIONS) -> None:
    """Move the last start's logs aside (x.log -> x.log.1 -> ... -> x.log.<keep>, the oldest dropped),
    so that each start's logs stand alone. Within one start, children restarted by the supervisor
    still append to theirs (the lines before a crash are what explains it)."""
    for log in log_dir.glob("*.log"):
        if not log.is_file():
            continue  # not ours to move (a directory named server.log is then reported as unwritable)
        for i in range(keep - 1, 0, -1):
            older = log.with_name(f"{log.name}.{i}")
            if older.exists():
                os.replace(older, log.with_name(f"{log.name}.{i + 1}"))
        os.replace(log, log.with_name(f"{log.name}.1"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return True


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def _ready(host: str, port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/v2/health/ready", timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _waiting_for(status: int, body: str) -> str:
    """What a not-ready answer of the health port says the start waits for."""
    if status == 0:
        return "the supervisor's health port"
    try:
        return json.loads(body).get("error_msg") or body
    except (ValueError, AttributeError):
        return body


def _start_failed(cfg: Config, log_dir: Path, code: int) -> None:
    """The supervisor ended during the start: the engine's one-line reason when its load failed
    (start_status.py), else the logs' last lines."""
    reason = start_status.read(log_dir).get("error")
    if code == LOAD_FAILED and reason:
        print(f"start_server: the engine failed to start: {reason}", file=sys.stderr)
        if not cfg.output_log_to_console:
            print(f"start_server: (its log: {log_dir / 'engine.log'})", file=sys.stderr)
        return
    print(f"start_server: the server exited during start-up (code {code})", file=sys.stderr)
    for name in ("server.log", "engine.log", "triton.log"):
        if not cfg.output_log_to_console and (t := _tail(log_dir / name)):
            print(f"--- {log_dir / name} (last lines)\n{t}", file=sys.stderr)


def start() -> int:
    # Every setting is read (and checked) here, once, before anything starts.
    try:
        cfg = Config.from_env()
    except ConfigError as e:
        print(f"start_server: {e}", file=sys.stderr)
        return 2
    node = 0
    if cfg.mp_nnode > 1:
        try:
            node = layout(cfg).node
        except ConfigError as e:
            print(f"start_server: {e}", file=sys.stderr)
            return 2
    log_dir = Path(cfg.log_dir)
    run_file = log_dir / RUN_FILE
    if run_file.exists():
        pid = json.loads(run_file.read_text())["pid"]
        if _alive(pid):
            print(f"start_server: already running (pid {pid}); run stop_server.sh first", file=sys.stderr)
            return 2
    problems = port_problems(cfg) if node == 0 else []  # other nodes listen on nothing
    if node == 0:  # Triton serves there: its package, named here rather than in a traceback of the supervisor's
        try:
            pytriton_root()
        except TritonNotFound as e:
            problems.append(str(e))
    if problems:
        for p in problems:
            print(f"start_server: {p}", file=sys.stderr)
        return 2
    # LOG_DIR holds the run file (and the logs): fail here, clearly, when it cannot be written.
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        probe = log_dir / f".llmserve-write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
        if not cfg.output_log_to_console:
            rotate_logs(log_dir)
        out = None if cfg.output_log_to_console else open(log_dir / "server.log", "ab")  # noqa: SIM115
    except OSError as e:
        where = e.filename or log_dir
        print(f"start_server: cannot write to LOG_DIR={log_dir} ({where}: {e.strerror or e})", file=sys.stderr)
        return 2
    if node != 0:
        return _start_worker_node(cfg, node, run_file, out)
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmserve.serving.supervisor"],
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: stop kills the whole tree
    )
    run_file.write_text(
        json.dumps(
            {"pid": proc.pid, "shm_prefix": shm_prefix(cfg.service_grpc_port), "health_port": cfg.health_http_port}
        )
    )
    timeout = cfg.start_timeout
    t0 = time.monotonic()
    deadline = t0 + timeout
    status, body, shown_wait = 0, "", ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            _start_failed(cfg, log_dir, proc.returncode)
            stop(cfg)
            return 1
        status, body = _ready(cfg.local_host, cfg.health_http_port)
        if status == 200:
            break
        if (waiting := _waiting_for(status, body)) != shown_wait:  # the progress line: each new phase
            print(f"  waiting ({time.monotonic() - t0:.0f} s): {waiting}", flush=True)
            shown_wait = waiting
        time.sleep(0.1)
    else:
        print(
            f"start_server: not ready after {timeout:.0f} s (last answer {status}: {body}); stopping", file=sys.stderr
        )
        stop(cfg)
        return 1
    shown = cfg.local_host
    print(f"llmserve is ready (pid {proc.pid}, logs: {'console' if cfg.output_log_to_console else log_dir})")
    print(f"  Triton gRPC        {shown}:{cfg.service_grpc_port}  (model 'model', input IN, output OUT)")
    print(f"  health             http://{shown}:{cfg.health_http_port}/v2/health/ready")
    print(f"  metrics            http://{shown}:{cfg.metrics_http_port}/metrics")
    if cfg.triton_metrics_port != -1:
        print(f"  Triton's metrics   http://{shown}:{cfg.triton_metrics_port}/metrics  (also in the above)")
    if http_frontend_enabled(cfg):
        print(f"  HTTP               http://{shown}:{cfg.service_http_port}/v1/chat/completions")
    return 0


def _start_worker_node(cfg: Config, node: int, run_file: Path, out) -> int:
    """A node other than 0 runs only its ranks (executor/node.py), which wait for node 0's rank 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmserve.executor.node"],
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    run_file.write_text(json.dumps({"pid": proc.pid, "shm_prefix": "", "health_port": None}))
    time.sleep(1.0)  # a launcher that cannot even start says so now, not later
    if proc.poll() is not None:
        print(f"start_server: node {node}'s launcher exited (code {proc.returncode}); see its log", file=sys.stderr)
        stop(cfg)
        return 1
    lay = layout(cfg)
    ranks = list(lay.node_ranks())
    print(
        f"llmserve node {node} started (pid {proc.pid}, logs: {'console' if cfg.output_log_to_console else cfg.log_dir})"
    )
    print(
        f"  ranks {ranks[0]}..{ranks[-1]} of MP_NUM={cfg.mp_num}; they serve through node 0 at {lay.master}:{lay.port}"
    )
    return 0


def _stop_settings() -> tuple[Config, int]:
    """The settings stop needs, and its exit code: 0, or 2 after naming what is bad. A bad setting must not
    keep the stack running: stop goes on with LOG_DIR as given and the default in place of every bad value."""
    try:
        return Config.from_env(), 0
    except ConfigError as e:
        print(f"stop_server: {e}; stopping anyway with the defaults in their place", file=sys.stderr)
    try:
        log_dir = Config.read("log_dir")
    except ConfigError:  # a plain string: it cannot be bad; this only keeps the fallback total
        log_dir = "log"
    return Config(log_dir=log_dir), 2


def stop(cfg: Config | None = None) -> int:
    code = 0
    if cfg is None:
        cfg, code = _stop_settings()
    run_file = Path(cfg.log_dir) / RUN_FILE
    if not run_file.exists():
        print(f"stop_server: no server running (no {run_file})")
        return code
    info = json.loads(run_file.read_text())
    pid = info["pid"]
    timeout = cfg.stop_timeout
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    # Whatever is left of the group (a child that ignored SIGTERM, or everything after a timeout).
    if _group_members(pid):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 5
        while _group_members(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    if info["shm_prefix"]:  # a worker node has none
        for f in Path("/dev/shm").glob(f"{info['shm_prefix']}*"):
            f.unlink(missing_ok=True)
    run_file.unlink(missing_ok=True)
    print(f"llmserve stopped (pid {pid})")
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check"]:
        try:
            Config.from_env()
        except ConfigError as e:
            print(f"start_server: {e}", file=sys.stderr)
            return 2
        return 0
    if argv[:1] == ["start"]:
        return start()
    if argv[:1] == ["stop"]:
        return stop()
    print("usage: python -m llmserve.serving.control start|stop|check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
