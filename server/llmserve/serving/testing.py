"""A stack started by start_server.sh on free loopback ports, for tests and tools.

with ServingStack(tmp_path, MODEL_DIR=...) as stack:
    stack.grpc_url, stack.ready(), stack.metrics()
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from llmserve.protocol import native
from llmserve.serving.control import RUN_FILE
from llmserve.serving.ports import bind_error

ROOT = Path(__file__).resolve().parents[3]
PORT_VARS = (
    "HEALTH_HTTP_PORT", "SERVICE_GRPC_PORT", "METRICS_HTTP_PORT", "INTER_PROC_PORT", "TRITON_METRICS_PORT", "DIST_PORT"
)  # fmt: skip


def record(body: dict) -> dict:
    """A native body as the Triton adapter sends it on to the engine: checked, then its record."""
    return native.record(native.parse(body))


def _ephemeral_low() -> int:
    """The first port the kernel hands out as the local end of outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports, below the ephemeral range: a port from that range (what
    bind(0) gives) can become the local end of one of the stack's own outgoing connections (a ZMQ
    client of the engine server, say) before the server meant to listen on it binds; Triton then
    failed to start with "address already in use". Each port is this process's for its life
    (`_claim`): a stack that stops and starts again on its ports finds them unclaimed by others."""
    rng = random.SystemRandom()
    hi = min(_ephemeral_low(), 32768)
    out: list[int] = []
    while len(out) < n:
        port = rng.randrange(20000, hi)
        if port_is_free(port) and _claim(port):
            out.append(port)
    return out


_claimed: set[int] = set()
_claims_fd: int | None = None  # kept open: closing any fd of the file drops the process's locks on it


def _claim(port: int) -> bool:
    """Claim `port` for this process's life against the other processes that pick ports here (the
    test suite's pytest-xdist workers): a lock on byte `port` of one file all of them share. Free
    between a stack's bind checks and its servers' binds, and between its stop and its next start,
    a port could otherwise be handed to a stack of another process."""
    global _claims_fd
    if port in _claimed:
        return False
    if _claims_fd is None:
        try:
            _claims_fd = os.open(
                os.path.join(tempfile.gettempdir(), "llmserve-test-ports.lock"), os.O_RDWR | os.O_CREAT
            )
        except OSError:
            _claims_fd = -1  # no shared file: claims hold within this process only
    if _claims_fd >= 0:
        try:
            fcntl.lockf(_claims_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
        except OSError:  # another process has it
            return False
    _claimed.add(port)
    return True


def port_is_free(port: int) -> bool:
    return bind_error("127.0.0.1", port) is None


class ServingStack:
    def __init__(self, work_dir: Path, **env: str) -> None:
        self.work_dir = Path(work_dir)
        self.log_dir = self.work_dir / "log"
        ports = dict(zip(PORT_VARS, free_ports(len(PORT_VARS))))
        self.env = dict(os.environ)
        self.env.update({k: str(v) for k, v in ports.items()})
        self.env.update(
            SERVICE_HTTP_PORT="-1",
            LLMSERVE_HOST="127.0.0.1",
            LOG_DIR=str(self.log_dir),
            LLMSERVE_START_TIMEOUT="120",
        )
        self.env.update({k: str(v) for k, v in env.items()})
        self.ports = {k: int(self.env[k]) for k in PORT_VARS}
        self.grpc_url = f"127.0.0.1:{self.ports['SERVICE_GRPC_PORT']}"

    # ---- lifecycle -----------------------------------------------------------------
    def start(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        # Files, not pipes: with OUTPUT_LOG_TO_CONSOLE=1 the server keeps writing to them.
        self.work_dir.mkdir(parents=True, exist_ok=True)
        out, err = self.work_dir / "start.out", self.work_dir / "start.err"
        with open(out, "w") as o, open(err, "w") as e:
            rc = subprocess.run(
                [str(ROOT / "start_server.sh"), *args], env=self.env, stdout=o, stderr=e, timeout=300
            ).returncode
        r = subprocess.CompletedProcess([], rc, out.read_text(), err.read_text())
        if check and r.returncode != 0:
            raise RuntimeError(f"start_server.sh failed ({r.returncode}):\n{r.stdout}\n{r.stderr}\n{self.logs()}")
        return r

    def stop(self) -> subprocess.CompletedProcess:
        return subprocess.run([str(ROOT / "stop_server.sh")], env=self.env, capture_output=True, text=True, timeout=90)

    def __enter__(self) -> ServingStack:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def supervisor_pid(self) -> int | None:
        f = self.log_dir / RUN_FILE
        return json.loads(f.read_text())["pid"] if f.exists() else None

    def child_pid(self, module: str) -> int:
        """Pid of the supervisor's child whose command line names `module`."""
        pid = self.supervisor_pid
        for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            if module in Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace"):
                return int(c)
        raise LookupError(module)

    def logs(self) -> str:
        out = []
        for f in sorted(self.log_dir.glob("*.log")):
            out.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-40:]))
        return "\n".join(out)

    # ---- probes ----------------------------------------------------------------------
    def _get(self, port_var: str, path: str) -> tuple[int, str]:
        url = f"http://127.0.0.1:{self.ports[port_var]}{path}"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def ready(self) -> tuple[int, str]:
        return self._get("HEALTH_HTTP_PORT", "/v2/health/ready")

    def live(self) -> tuple[int, str]:
        return self._get("HEALTH_HTTP_PORT", "/v2/health/live")

    def metrics(self) -> dict[str, float]:
        """Samples of the metrics endpoint: 'name{labels}' -> value."""
        status, text = self._get("METRICS_HTTP_PORT", "/metrics")
        assert status == 200, text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def wait_ready(self, timeout: float = 120) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.ready()[0] == 200:
                return time.monotonic() - t0
            time.sleep(0.2)
        raise TimeoutError(f"not ready after {timeout} s: {self.ready()}\n{self.logs()}")


def wait_until(pred, timeout: float = 5.0, every: float = 0.02) -> bool:
    """Whether `pred()` came true within `timeout` seconds (asked every `every` seconds)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


# ---- reliability helpers -----------------------------------------------------------
def http_stack(work_dir: Path, **env) -> ServingStack:
    """A ServingStack with the HTTP front end on a free loopback port (`stack.http_base`)."""
    (port,) = free_ports(1)
    env = {"SERVICE_HTTP_PORT": port, **env}
    stack = ServingStack(work_dir, **env)
    if "MODEL_DIR" not in env:
        stack.env.pop("MODEL_DIR", None)  # the demo model
    stack.ports["SERVICE_HTTP_PORT"] = int(stack.env["SERVICE_HTTP_PORT"])
    stack.http_base = f"http://127.0.0.1:{stack.ports['SERVICE_HTTP_PORT']}"  # type: ignore[attr-defined]
    return stack


def proc_stats() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, utime + stime in clock ticks) of every live (not zombie) process."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            out[int(stat.parent.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return out


def _ppid_map() -> dict[int, int]:
    return {pid: ppid for pid, (ppid, _) in proc_stats().items()}


def process_tree(root: int) -> list[int]:
    """`root` and every live descendant."""
    parents = _ppid_map()
    tree, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        if pid in parents:
            tree.append(pid)
            frontier += [p for p, pp in parents.items() if pp == pid]
    return tree


def resource_counts(root: int) -> dict[str, int]:
    """Processes, threads (/proc/<pid>/status) and open file descriptors (/proc/<pid>/fd) of a tree."""
    procs = threads = fds = 0
    for pid in process_tree(root):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            n_fd = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
        procs += 1
        threads += int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))
        fds += n_fd
    return {"processes": procs, "threads": threads, "fds": fds}
