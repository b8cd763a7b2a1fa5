"""5xx answers the HTTP front end makes itself (a bug, a body that cannot be encoded), counted in
llmserve_request_failure_total beside the engine's own failures (serving/metrics.py).

The metrics live in the supervisor, the front end in other processes: each worker keeps its counts
in a small JSON file of the log directory named by the supervisor's pid and its own
(`http_failures/<supervisor>-<worker>.json`, rewritten whole at each failure), and the supervisor
adds them up at each scrape. Failures the engine answered (an error item) are counted there, not here.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path

log = logging.getLogger("llmserve.http")

SUPERVISOR_ENV = "LLMSERVE_HTTP_SUPERVISOR_PID"  # set by http/server.py's main for its workers
DIR_NAME = "http_failures"

_counts: Counter[int] = Counter()
_file: Path | None = None


def setup(log_dir: str) -> None:
    """In a served worker (the supervisor's front end): where this process's counts go."""
    global _file
    sup = os.environ.get(SUPERVISOR_ENV)
    if sup:
        _file = Path(log_dir) / DIR_NAME / f"{sup}-{os.getpid()}.json"


def count(status: int) -> None:
    """One answer with this (5xx) status that no engine error item stands for."""
    _counts[status] += 1
    if _file is None:
        return
    try:
        _file.parent.mkdir(parents=True, exist_ok=True)
        tmp = _file.with_suffix(".tmp")
        tmp.write_text(json.dumps({str(k): v for k, v in _counts.items()}))
        tmp.replace(_file)  # whole: a scrape never reads half a file
    except OSError as e:
        log.warning("cannot record an HTTP failure in %s: %s", _file, e)


def totals(log_dir: str, supervisor_pid: int) -> Counter[str]:
    """status -> count, over the front-end workers of that supervisor (dead ones too)."""
    out: Counter[str] = Counter()
    for f in (Path(log_dir) / DIR_NAME).glob(f"{supervisor_pid}-*.json"):
        try:
            out.update({k: int(v) for k, v in json.loads(f.read_text()).items()})
        except (OSError, ValueError):
            continue  # a file being replaced: read at the next scrape
    return out
