"""The engine server's process: it binds the adapters' socket, resolves the model (exporting the demo on a
first start), starts the engine core, and serves (engine_server.py) until it is stopped. A load that fails
says why in one line (start_status.py) and is not retried."""

from __future__ import annotations

import logging
import os
import signal
import time

import zmq

from llmserve.config import Config
from llmserve.engine.heap import freeze_startup_objects
from llmserve.serving import preflight, start_status
from llmserve.serving.engine_core import CoreLink, CoreLoadError
from llmserve.serving.engine_server import EngineServer
from llmserve.serving.ipc import endpoint
from llmserve.serving.start_status import LOAD_FAILED
from llmserve.utils.process import exit_now

log = logging.getLogger(__name__)


def listen(config: Config) -> zmq.Socket:
    """The adapters' socket, bound on INTER_PROC_PORT before anything else starts. Bound only once the
    model had loaded, the port was once found taken on a GPU box at every restart, for minutes (what held
    it was not seen): the default 56666 lies in Linux's ephemeral range, so the local end of any outgoing
    connection made meanwhile can take it."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    # A send to a client whose connection is gone raises EHOSTUNREACH instead of vanishing: that is
    # how a dead client (a killed Triton stub) is noticed, and its requests aborted (see _reap).
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    try:
        sock.bind(endpoint(config.inter_proc_port))
    except zmq.ZMQError as e:
        sock.close(0)
        raise RuntimeError(
            f"INTER_PROC_PORT={config.inter_proc_port}: cannot listen on {endpoint(config.inter_proc_port)} ({e}); "
            f"another process holds it (`ss -tanp | grep :{config.inter_proc_port}`): choose a free port, "
            "preferably below the ephemeral range (/proc/sys/net/ipv4/ip_local_port_range)"
        ) from None
    return sock


def start(config: Config) -> EngineServer:
    """Listen for the adapters, resolve the model (building the demo model when none), start the core,
    load the tokenizer."""
    from llmserve.engine.tokenizer import load_tokenizer
    from llmserve.runners.model_dir import resolve_model_dir

    missing = preflight.problems(config)
    if missing:
        raise RuntimeError("; ".join(missing))
    for line in preflight.features_off():
        log.warning("%s", line)
    sock = listen(config)
    core = None
    try:
        log.info("resolving the model (exporting the demo model on a first start)")
        model_dir = resolve_model_dir(config)
        env = {**os.environ, **config.to_env(), "MODEL_DIR": str(model_dir)}
        # A CPU model leaves one core to this process and the rest of the stack: with every core its math
        # threads are preempted at each step's output work, and wait on each other (2 cores: 30% slower).
        if config.paddle_threads == 0:  # automatic
            env["LLMSERVE_PADDLE_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) - 1))
        log.info("starting the engine core")
        core = CoreLink(zmq.Context.instance(), env)
        tokenizer = load_tokenizer(str(model_dir), use_hf=config.use_hf_tokenizer)
        log.info("the engine core is loading the model")
        core.wait_ready()
    except BaseException:
        if core is not None:
            core.proc.kill()
        sock.close(0)
        raise
    return EngineServer(config, core, tokenizer, sock)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = Config.from_env()
    t0 = time.monotonic()
    phases = start_status.track(config.log_dir, "engine")
    try:
        server = start(config)
    except BaseException as e:  # noqa: BLE001 - one line says why (the core's own, when it wrote one); no retry
        start_status.untrack(phases)  # the lines below are no phase: they must not overwrite the reason
        if isinstance(e, CoreLoadError) and e.code == LOAD_FAILED:
            log.error("loading failed: %s", start_status.read(config.log_dir).get("error") or e)
        else:
            log.exception("loading failed")
        start_status.fail(config.log_dir, start_status.one_line(e))
        exit_now(LOAD_FAILED)
    start_status.untrack(phases)
    start_status.write(config.log_dir, phase="engine: loaded, starting to serve")
    freeze_startup_objects()
    log.info("engine ready in %.1f s", time.monotonic() - t0)

    def stop(*_):
        server.stopping = True

    def drain(*_):
        server.draining = True
        server.next_hb = 0.0  # the supervisor's drain waits for a heartbeat that says so: send it now
        log.info("draining: new requests get 503, %d in flight finish", len(server.live))

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGUSR1, drain)
    server.serve()
    # 1: the core died, and the supervisor restarts us (and so the core).
    exit_now(1 if not server.core.alive() and not server.stopping else 0)


if __name__ == "__main__":
    main()
