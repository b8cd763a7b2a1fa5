"""LLMSERVE_INTAKE_TRACE: when each layer of the served stack took in each request and saw its first
token, for finding which hop holds a burst (docs/benchmarks.md). Every process of the stack appends to
the same file, one line an event (a short O_APPEND write: lines do not interleave):

    wall-clock time (s)  layer  req_id

Layers in the order a request meets them: `http` (a front-end worker has parsed it and queues it for
its gRPC stream), `http_sent` (the stream's writer, which writes one request at a time, got its write
back: the queue's wait and the write; the write completes in gRPC before the worker's loop resumes the
writer, so this mark may follow the adapter's), `adapter` (the Triton model got it), `server` (the
engine server admitted it and handed it to the core), then its first token at `server_first` (the
engine server) and `http_first` (the front-end worker). Requests sent to Triton directly have only the
adapter's and the server's marks. scripts/lab/intake_report.py turns a file into each hop's delays. Off
unless set; one write per event when on: for diagnosis.
"""

from __future__ import annotations

import os
import time

from llmserve.config import Config

LAYERS = ("http", "http_sent", "adapter", "server", "server_first", "http_first")  # in the order a request meets them
_PATH: str = Config.read("intake_trace")  # read once, at import (the marks run per request)
_file = None
_pid = 0


def mark(layer: str, req_id: str) -> None:
    global _file, _pid
    if not _PATH:
        return
    if _file is None or _pid != os.getpid():  # opened by the process that writes (workers may fork)
        _file, _pid = open(_PATH, "a", buffering=1), os.getpid()  # noqa: SIM115 - for the process's life
    _file.write(f"{time.time():.6f} {layer} {req_id}\n")
