"""The supervisor: starts and watches tritonserver and the engine process,
serves health probes and metrics.

- The engine process is restarted whenever it exits (or hangs: no heartbeat, or
  no step finished while it has work, for 3 x CHECK_HEALTH_INTERVAL) after it was
  ready once; tritonserver likewise. An engine that dies before it was ever ready
  (its load failed: a refused setting, a model it cannot load, a missing package,
  out of memory) is not retried: the supervisor stops everything and exits with
  LOAD_FAILED, its reason in LOG_DIR/engine.status.json (start_status.py), which
  start_server.sh prints. While the engine starts, not-ready answers name its phase.
- HEALTH_HTTP_PORT: KServe v2 health and metadata (llmserve.serving.probes); ready
  is 200 when Triton, the model and the engine are all up, else 500 with
  error_code 1 not ready | 2 engine down | 3 engine hung.
- METRICS_HTTP_PORT: Triton's metrics (from TRITON_METRICS_PORT, fetched in the background:
  a scrape never waits on Triton) + llmserve_* (live).
- tritonserver's output goes through the supervisor into triton.log, where one known-harmless
  error line is turned into a warning (see TRITON_LOG_REWRITES).

SIGTERM/SIGINT stop everything gracefully: first a drain (the engine refuses new
requests with 503 while those in flight finish, for up to LLMSERVE_DRAIN_TIMEOUT
seconds; ready turns 500), then the front end, Triton and the engine, in turn.
Run through `start_server.sh` (llmserve.serving.control), which checks ports first.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import re
import secrets
import signal
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import zmq

from llmserve.config import Config
from llmserve.serving import start_status
from llmserve.serving.ipc import EngineLink
from llmserve.serving.metrics import EngineMetrics, TritonMetrics
from llmserve.serving.probes import HealthHandler, MetricsHandler, model_metadata
from llmserve.serving.start_status import LOAD_FAILED
from llmserve.serving.tritonserver import DEFAULT_MODEL_REPOSITORY, MODEL_NAME, triton_command
from llmserve.utils.child_process import Child

log = logging.getLogger("llmserve.supervisor")

NOT_READY, ENGINE_DOWN, ENGINE_HUNG = 1, 2, 3
HTTP_FRONTEND_MODULE = "llmserve.http.server"  # started when it exists and SERVICE_HTTP_PORT != -1

# A GPU build of Triton (the wheel's) sets up its CUDA block manager at start whatever the flags, and
# logs its failure as an error where libcuda.so is missing, though "the server can still function
# properly" (Triton's own comment; core/src/server.cc). Our model runs on Triton's CPU side, so that
# line is a warning to us: rewritten as one, and no error line is left on a clean CPU start.
TRITON_LOG_REWRITES = [
    (
        re.compile(rb"^E(\d{4} [^\]]*\] \"?CudaDriverHelper has not been initialized\.\"?)(\r?\n)?$"),
        rb"W\1 (llmserve: no CUDA driver library: harmless, our Triton model needs none)\2",
    ),
]


def rewrite_triton_line(line: bytes) -> bytes:
    for pattern, repl in TRITON_LOG_REWRITES:
        line = pattern.sub(repl, line)
    return line


def http_frontend_enabled(cfg: Config) -> bool:
    return cfg.service_http_port != -1 and importlib.util.find_spec(HTTP_FRONTEND_MODULE) is not None


STUB = "triton_python_backend_stub"


def stub_state(triton_pid: int) -> tuple[int, int]:
    """tritonserver's Python-backend stubs (one per model instance): (alive, dead: zombies)."""
    alive = dead = 0
    for children in Path(f"/proc/{triton_pid}/task").glob("*/children"):
        try:
            pids = children.read_text().split()
        except OSError:
            continue
        for pid in pids:
            try:
                if STUB not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    continue
                zombie = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] == "Z"
            except (OSError, IndexError):
                zombie = True
            dead += zombie
            alive += not zombie
    return alive, dead


class Supervisor:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.host = cfg.host
        self.log_dir = None if cfg.output_log_to_console else Path(cfg.log_dir)
        self.metrics = EngineMetrics()
        self.stop_asked = False  # SIGTERM/SIGINT (on_signal); the main loop then sets `stopping`
        self.stopping = threading.Event()  # the main loop has left: drain, stop
        self.closed = threading.Event()  # the monitor thread's end (it must see the drain)
        self.draining = False
        self.engine_live: int | None = None  # requests in flight in the engine (its last stats)
        self.engine_draining = False
        self.stub_seen: tuple[int, int] | None = None  # (tritonserver pid, its stubs) seen alive when ready
        self.next_stub_check = 0.0
        self.last_hb: float | None = None
        self.engine_was_ready = False  # a heartbeat came once: from then on a dead engine is restarted
        self.status_dir = Path(cfg.log_dir)  # start_status's file (also with console logs: the run file is there)
        start_status.clear(self.status_dir)  # a former start's phase or reason is not this one's
        self.stalled = 0.0  # how long the engine has had work without finishing a step (its last stats)
        self.adapters = 0
        self.triton_ready = False
        # What the health port tells KServe clients about the model: its versions from the repository,
        # its metadata from Triton itself, once it has served it (_poll_triton).
        self.model_name = MODEL_NAME
        repo = DEFAULT_MODEL_REPOSITORY / MODEL_NAME
        self.model_versions = sorted(p.name for p in repo.iterdir() if p.is_dir() and p.name.isdigit()) or ["1"]
        self.model_metadata: dict | None = None
        self.triton_metrics = (
            TritonMetrics(f"http://{cfg.local_host}:{cfg.triton_metrics_port}/metrics")
            if cfg.triton_metrics_port != -1
            else None
        )
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        launch = triton_command(
            grpc_port=cfg.service_grpc_port,
            metrics_port=cfg.triton_metrics_port,
            work_dir=cfg.cache_path / "triton",
            host=self.host,
            extra_env={"PYTHONUNBUFFERED": "1"},
            config=cfg,
        )
        self.shm_prefix = launch.shm_prefix
        self.engine = Child(
            "engine", [sys.executable, "-m", "llmserve.serving.engine_process"], env, self._log("engine.log")
        )
        self.triton = Child(
            "tritonserver", launch.argv, launch.env, self._log("triton.log"), rewrite=rewrite_triton_line
        )
        self.children = [self.engine, self.triton]
        if http_frontend_enabled(cfg):
            self.children.append(
                Child("http", [sys.executable, "-m", HTTP_FRONTEND_MODULE], env, self._log("http.log"))
            )

    def _log(self, name: str) -> Path | None:
        return self.log_dir / name if self.log_dir else None

    # ---- health ------------------------------------------------------------------
    def health(self) -> tuple[int, str]:
        """(0, "") when ready, else (error_code, message)."""
        if self.draining:
            return NOT_READY, "the server is shutting down (draining requests in flight)"
        if self.engine.proc is None:  # the probes answer before the children are started
            return NOT_READY, "the engine is starting"
        if not self.engine.alive():
            return ENGINE_DOWN, "the engine process is down (restarting)"
        if self.last_hb is None:
            phase = start_status.read(self.status_dir).get("phase")
            return NOT_READY, f"the engine is starting ({phase})" if phase else "the engine is starting"
        age = time.monotonic() - self.last_hb
        if age > self.cfg.check_health_interval:
            return ENGINE_HUNG, f"no heartbeat from the engine for {age:.1f} s"
        if self.stalled > self.cfg.check_health_interval:
            return ENGINE_HUNG, f"the engine has made no progress for {self.stalled:.1f} s"
        if not self.triton.alive() or not self.triton_ready:
            return NOT_READY, "Triton server or model not ready (starting Triton, loading its model)"
        if self.adapters == 0:
            return NOT_READY, "the Triton model has not connected to the engine yet"
        return 0, ""

    # ---- threads -----------------------------------------------------------------
    def _monitor(self) -> None:
        """Receive the engine's heartbeats/stats."""
        link = EngineLink(self.cfg.inter_proc_port, "monitor", f"monitor-{os.getpid()}", zmq.Context.instance())
        poller = zmq.Poller()
        link.register(poller)
        while not self.closed.is_set():
            events = dict(poller.poll(200))
            if link.monitor in events and "disconnected" in link.events():
                self.last_hb, self.adapters = None, 0
                self.metrics.engine_down()
            if link.sock in events:
                for msg in link.recv_all():
                    if msg.get("op") == "stats":
                        self.last_hb = time.monotonic()
                        self.engine_was_ready = True
                        self.stalled = msg.get("stalled", 0.0)
                        self.adapters = msg["adapters"]
                        self.engine_live = msg.get("live")
                        self.engine_draining = bool(msg.get("draining"))
                        self.metrics.apply(msg)
        link.close()

    def _poll_triton(self) -> None:
        import tritonclient.grpc as grpcclient

        from llmserve.serving.grpc_channel import channel_args

        url = f"{self.cfg.local_host}:{self.cfg.service_grpc_port}"
        client = grpcclient.InferenceServerClient(url, channel_args=channel_args())
        while not self.stopping.is_set():
            try:
                self.triton_ready = client.is_server_ready(client_timeout=2) and client.is_model_ready(
                    MODEL_NAME, client_timeout=2
                )
                if self.triton_ready and self.model_metadata is None:
                    self.model_metadata = model_metadata(client.get_model_metadata(MODEL_NAME, client_timeout=2))
                    self.model_versions = self.model_metadata["versions"] or self.model_versions
            except Exception:
                self.triton_ready = False
            # Often until Triton is first ready (start-up waits for it), then every 0.5 s.
            self.stopping.wait(0.5 if self.model_metadata is not None else 0.1)
        client.close()

    def _serve_http(self, port: int, handler: type) -> ThreadingHTTPServer:
        server = ThreadingHTTPServer((self.host, port), handler)
        server.daemon_threads = True
        server.supervisor = self  # type: ignore[attr-defined]
        # A short poll interval: shutdown() waits for the loop's next look (0.5 s by default, per server).
        threading.Thread(target=server.serve_forever, args=(0.05,), name=f"http-{port}", daemon=True).start()
        return server

    def on_signal(self, *_) -> None:
        """SIGTERM/SIGINT: a flag, no lock. Python runs a handler in the main thread between any two
        bytecodes, so also where that thread holds a lock (an Event's, in its own wait): the handler's
        Event.set then waits on its own thread forever (a stop once hung 30 s, until SIGKILL)."""
        self.stop_asked = True

    # ---- main loop -----------------------------------------------------------------
    def run(self) -> int:
        servers = [
            self._serve_http(self.cfg.health_http_port, HealthHandler),
            self._serve_http(self.cfg.metrics_http_port, MetricsHandler),
        ]
        for target in (self._monitor, self._poll_triton):
            threading.Thread(target=target, daemon=True).start()
        if self.triton_metrics:
            self.triton_metrics.start()
        for c in self.children:
            c.start()
        hung_limit = 3 * self.cfg.check_health_interval
        code = 0
        while True:
            time.sleep(0.2)
            if self.stop_asked:
                break
            now = time.monotonic()
            if not self.engine.alive() and not self.engine_was_ready:
                code = self._load_failed()
                break
            for c in self.children:
                if c.alive() or self.stop_asked:
                    continue
                if c.restart_at is None:
                    code = c.proc.returncode if c.proc else None
                    # Back off when it keeps dying right after start.
                    delay = 1.0 if now - c.started_at > 30 else min(10.0, 1.0 * 2 ** min(c.restarts, 3))
                    log.error("%s exited (code %s): restarting in %.0f s", c.name, code, delay)
                    c.restart_at = now + delay
                    if c is self.triton:
                        self.triton_ready = False  # until the next one says so (_check_stub relies on it)
                    if c is self.engine:
                        self.last_hb = None
                        self.metrics.engine_down()
                elif now >= c.restart_at:
                    c.restarts += 1
                    if c is self.engine:
                        start_status.clear(self.status_dir)  # the last engine's phase is not the new one's
                    c.start()
            self._check_stub(now)
            if self.engine.alive() and self.last_hb is not None:
                silent, stalled = now - self.last_hb, self.stalled + (now - self.last_hb)
                if silent > hung_limit or stalled > hung_limit:
                    log.error(
                        "engine hung (no heartbeat for %.0f s, no progress for %.0f s): killing it", silent, stalled
                    )
                    self.engine.stop(signal.SIGKILL)  # its core dies with it
                    self.last_hb, self.stalled = None, 0.0
        self.stopping.set()
        self._shutdown(servers)
        if code == 0:  # a failed start's reason stays (start_server.sh prints it; a record of why)
            start_status.clear(self.status_dir)
        return code

    def _load_failed(self) -> int:
        """The engine died before it was ever ready: its load failed, and would again. Say why, stop."""
        rc = self.engine.proc.returncode
        reason = start_status.read(self.status_dir).get("error")
        if not reason:  # killed, or it died before it could write (a crash in C, the OOM killer)
            reason = f"the engine {start_status.exit_reason(rc)} before it was ready"
            start_status.fail(self.status_dir, reason)
        log.error("the engine failed to start (code %s): %s; not restarting it: stopping", rc, reason)
        return LOAD_FAILED

    def _check_stub(self, now: float) -> None:
        """Triton does not restart the stub of a decoupled Python model that died: every request then
        fails ("Stub process is not healthy") while Triton still reports the model ready. Restart Triton."""
        if now < self.next_stub_check or not self.triton.alive():
            return
        self.next_stub_check = now + 0.5
        pid = self.triton.proc.pid
        alive, dead = stub_state(pid)
        seen = self.stub_seen[1] if self.stub_seen and self.stub_seen[0] == pid else 0
        if alive and not dead and alive >= seen:
            if self.triton_ready:  # the stubs of the loaded model: one that comes and goes while loading is no death
                self.stub_seen = (pid, alive)
        elif seen:  # one that was up is gone or a zombie
            log.error("a Triton Python-backend stub died: restarting tritonserver")
            self.triton_ready = False
            self.stub_seen = None
            self.triton.stop(signal.SIGKILL)

    def _drain(self) -> None:
        """Let requests in flight finish (up to LLMSERVE_DRAIN_TIMEOUT s) while new ones get 503."""
        self.draining = True
        grace = self.cfg.drain_timeout
        if grace <= 0 or not self.engine.alive() or self.last_hb is None:
            return
        log.info("draining: new requests get 503; waiting up to %.0f s for those in flight", grace)
        self.engine.stop(signal.SIGUSR1)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.engine.alive():
            # Wait for a heartbeat sent after the drain began that shows nothing in flight.
            if self.engine_draining and self.engine_live == 0:
                log.info("drained")
                return
            time.sleep(0.05)
        log.warning("drain: %s requests still in flight after %.0f s", self.engine_live, grace)

    def _shutdown(self, servers: list[ThreadingHTTPServer]) -> None:
        log.info("stopping")
        self._drain()
        self.closed.set()
        if self.triton_metrics:
            self.triton_metrics.stop()
        # All at once: the drain has already turned new requests away, so no order is needed, and each
        # child's stop (Triton unloads its instances, the engine its model) no longer waits for the
        # others' (a stop took 4.7 s with one at a time, the sum of theirs). A request that outlived
        # the drain gets the engine's "shutting down" error through adapters that are still up.
        deadline = time.monotonic() + 15
        for c in self.children:
            c.stop()
        for c in self.children:
            c.wait(deadline)
        for s in servers:
            s.shutdown()
            s.server_close()
        for f in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            f.unlink(missing_ok=True)
        log.info("stopped")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    cfg = Config.from_env()
    if not cfg.edge_token:  # the front end's and the adapter's shared secret: the children inherit it
        cfg = dataclasses.replace(cfg, edge_token=secrets.token_hex(16))
        os.environ.update(cfg.to_env("edge_token"))
    sup = Supervisor(cfg)

    signal.signal(signal.SIGTERM, sup.on_signal)
    signal.signal(signal.SIGINT, sup.on_signal)
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
