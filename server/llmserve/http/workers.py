"""PUSH_MODE_HTTP_WORKERS > 1: worker processes, each with its own listening socket on the port.

uvicorn's own workers share one listening socket, and an event loop that wakes up accepts every
connection waiting: a burst of new connections goes mostly to one worker (256 at once on 4 workers:
117-193 to one of them) and queues behind its event loop while the others idle. Here each worker
binds a socket of its own with SO_REUSEPORT, so the kernel spreads connections over the workers by
a hash of their addresses, and a worker that dies takes its socket, and only its connections, along.

The parent restarts a worker that dies, unless it failed to start (the app or the port is broken,
and would be again: the parent then exits, and the supervisor restarts the front end with a back-off),
and stops them all, gracefully, on SIGTERM or SIGINT.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
import time

from llmserve.serving.ports import bind_error, family

log = logging.getLogger("uvicorn.error")

POLL_S = 0.5  # how often the parent looks for dead workers
STOP_GRACE_S = 5.0  # beyond uvicorn's own graceful shutdown, before a worker is killed


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) that other SO_REUSEPORT sockets may share."""
    sock = socket.socket(family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _worker(kwargs: dict) -> None:
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE

    config = uvicorn.Config(**kwargs)
    try:
        sock = reuse_port_socket(config.host, config.port)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", config.host, config.port, e)
        sys.exit(STARTUP_FAILURE)
    uvicorn.Server(config).run(sockets=[sock])


def run_workers(workers: int, **uvicorn_kwargs) -> int:
    """Serve uvicorn.Config(**uvicorn_kwargs) from `workers` processes until SIGTERM/SIGINT; the exit code."""
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE

    config = uvicorn.Config(**uvicorn_kwargs)  # configures logging, as uvicorn.run does
    # Nothing may listen there, SO_REUSEPORT or not: workers of an earlier front end still stopping
    # would otherwise share the port with ours.
    if bind_error(config.host, config.port) is not None:
        log.error("cannot listen on %s:%d: the address is in use", config.host, config.port)
        return 1
    stop: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _: stop.append(s))
    ctx = multiprocessing.get_context("spawn")

    def start() -> multiprocessing.process.BaseProcess:
        p = ctx.Process(target=_worker, args=(uvicorn_kwargs,))
        p.start()
        log.info("started worker process [%d]", p.pid)
        return p

    log.info("started parent process [%d]: %d workers, each its own socket (SO_REUSEPORT)", os.getpid(), workers)
    procs = [start() for _ in range(workers)]
    code = 0
    while not stop:
        time.sleep(POLL_S)
        for i, p in enumerate(procs):
            if stop or p.is_alive():
                continue
            if p.exitcode == STARTUP_FAILURE:
                log.error("worker process [%d] failed to start: stopping", p.pid)
                stop.append(0)
                code = 1
                break
            log.info("worker process [%d] died (exit code %s): starting another", p.pid, p.exitcode)
            procs[i] = start()
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + (config.timeout_graceful_shutdown or 0) + STOP_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    log.info("stopped parent process [%d]", os.getpid())
    return code
