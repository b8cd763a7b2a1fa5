"""The push-mode HTTP front end process: uvicorn with PUSH_MODE_HTTP_WORKERS workers (workers.py).

`python -m llmserve.http` (or `python -m llmserve.http.server`, which the
supervisor started by start_server.sh runs) listens on LLMSERVE_HOST
(default 0.0.0.0):SERVICE_HTTP_PORT (-1: no front end, exit at once) and
forwards every request to Triton's gRPC endpoint on SERVICE_GRPC_PORT.
"""

from __future__ import annotations

import argparse
import os
import sys

from llmserve.config import Config, ConfigError
from llmserve.serving.http_failures import SUPERVISOR_ENV

PARENT_ENV = "LLMSERVE_HTTP_PARENT_PID"


def die_with_parent() -> None:
    """In a uvicorn worker process: get SIGTERM when the uvicorn parent dies.

    Otherwise, when the parent is killed (SIGKILL, OOM), its orphaned workers keep the listening
    socket, and every restart of the front end fails with "Address already in use".
    """
    parent = os.environ.get(PARENT_ENV)
    if not parent or int(parent) == os.getpid() or not sys.platform.startswith("linux"):
        return  # not a worker of our uvicorn parent (single-process mode, tests)
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != int(parent):  # it died before we asked
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = Config.from_env()
    except ConfigError as e:
        print(f"llmserve.http: {e}", file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(prog="python -m llmserve.http", description=__doc__)
    p.add_argument("--host", default=cfg.host, help="address to bind (default LLMSERVE_HOST: %(default)s)")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    if cfg.service_http_port == -1:
        print("llmserve.http: SERVICE_HTTP_PORT=-1, no HTTP front end")
        return 0
    import uvicorn

    os.environ[PARENT_ENV] = str(os.getpid())  # the workers inherit it: see die_with_parent
    os.environ[SUPERVISOR_ENV] = str(os.getppid())  # whose metrics count the workers' 5xx (serving/http_failures.py)
    from llmserve.http.limits import LimitedHttpToolsProtocol

    settings = dict(
        app="llmserve.http.app:create_app",
        factory=True,
        host=args.host,
        port=cfg.service_http_port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        access_log=False,
        http=LimitedHttpToolsProtocol,  # caps the request head (431); the app caps the body (413)
    )
    if cfg.http_workers > 1:  # each worker its own socket: a burst spreads over them (workers.py)
        from llmserve.http.workers import run_workers

        return run_workers(cfg.http_workers, **settings)
    uvicorn.run(**settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
