"""`start` and `stop` behind start_server.sh / stop_server.sh.

start: validate every setting and check every port *before* anything starts,
launch the supervisor in its own session (logs under LOG_DIR, or the console
with OUTPUT_LOG_TO_CONSOLE=1), wait until /v2/health/ready answers 200, print
the endpoints. stop: SIGTERM the supervisor, wait (LLMSERVE_STOP_TIMEOUT,
default 30 s), then kill what is left of its process group and remove its
/dev/shm regions. The run file LOG_DIR/llmserve.run.json ties the two together.
"""

from __future__ import annotations

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
from llmserve.serving.supervisor import bind_host, http_frontend_enabled
from llmserve.triton.launcher import shm_prefix

RUN_FILE = "llmserve.run.json"


def port_problems(cfg: Config, host: str) -> list[str]:
    """One message per port that is taken (or set twice), naming its variable."""
    ports = {
        "HEALTH_HTTP_PORT": (cfg.health_http_port, host),
        "SERVICE_GRPC_PORT": (cfg.service_grpc_port, host),
        "METRICS_HTTP_PORT": (cfg.metrics_http_port, host),
        "INTER_PROC_PORT": (cfg.inter_proc_port, "127.0.0.1"),
    }
    if http_frontend_enabled(cfg):
        ports["SERVICE_HTTP_PORT"] = (cfg.service_http_port, host)
    problems, seen = [], {}
    for name, (port, h) in ports.items():
        if port in seen:
            problems.append(f"{name}={port} is the same port as {seen[port]}")
            continue
        seen[port] = name
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((h, port))
            except OSError as e:
                problems.append(f"port {port} ({name}) is already in use on {h}: {e.strerror}")
    return problems


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


def _ready(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as r:
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


def start() -> int:
    try:
        cfg = Config.from_env()
    except ConfigError as e:
        print(f"start_server: {e}", file=sys.stderr)
        return 2
    host = bind_host()
    log_dir = Path(cfg.log_dir)
    run_file = log_dir / RUN_FILE
    if run_file.exists():
        pid = json.loads(run_file.read_text())["pid"]
        if _alive(pid):
            print(f"start_server: already running (pid {pid}); run stop_server.sh first", file=sys.stderr)
            return 2
    problems = port_problems(cfg, host)
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
        out = None if cfg.output_log_to_console else open(log_dir / "server.log", "ab")  # noqa: SIM115
    except OSError as e:
        where = e.filename or log_dir
        print(f"start_server: cannot write to LOG_DIR={log_dir} ({where}: {e.strerror or e})", file=sys.stderr)
        return 2
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
    timeout = float(os.environ.get("LLMSERVE_START_TIMEOUT", "600"))
    deadline = time.monotonic() + timeout
    status, body = 0, ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print(f"start_server: the server exited during start-up (code {proc.returncode})", file=sys.stderr)
            for name in ("server.log", "engine.log", "triton.log"):
                if not cfg.output_log_to_console and (t := _tail(log_dir / name)):
                    print(f"--- {log_dir / name} (last lines)\n{t}", file=sys.stderr)
            stop(cfg)
            return 1
        status, body = _ready(cfg.health_http_port)
        if status == 200:
            break
        time.sleep(0.3)
    else:
        print(
            f"start_server: not ready after {timeout:.0f} s (last answer {status}: {body}); stopping", file=sys.stderr
        )
        stop(cfg)
        return 1
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    print(f"llmserve is ready (pid {proc.pid}, logs: {'console' if cfg.output_log_to_console else log_dir})")
    print(f"  Triton gRPC        {shown}:{cfg.service_grpc_port}  (model 'model', input IN, output OUT)")
    print(f"  health             http://{shown}:{cfg.health_http_port}/v2/health/ready")
    print(f"  metrics            http://{shown}:{cfg.metrics_http_port}/metrics")
    if http_frontend_enabled(cfg):
        print(f"  HTTP               http://{shown}:{cfg.service_http_port}/v1/chat/completions")
    return 0


def stop(cfg: Config | None = None) -> int:
    try:
        cfg = cfg or Config.from_env()
    except ConfigError as e:
        print(f"stop_server: {e}", file=sys.stderr)
        return 2
    run_file = Path(cfg.log_dir) / RUN_FILE
    if not run_file.exists():
        print(f"stop_server: no server running (no {run_file})")
        return 0
    info = json.loads(run_file.read_text())
    pid = info["pid"]
    timeout = float(os.environ.get("LLMSERVE_STOP_TIMEOUT", "30"))
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
    for f in Path("/dev/shm").glob(f"{info['shm_prefix']}*"):
        f.unlink(missing_ok=True)
    run_file.unlink(missing_ok=True)
    print(f"llmserve stopped (pid {pid})")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["start"]:
        return start()
    if argv[:1] == ["stop"]:
        return stop()
    print("usage: python -m llmserve.serving.control start|stop", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
