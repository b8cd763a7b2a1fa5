"""What the engine is doing while it starts, and why it failed: LOG_DIR/engine.status.json.

The engine server and its core write it as they load (each INFO line their loggers log while
starting: exporting the demo, loading the model, warming up, ...), and once, on a load that fails,
the one-line reason. The supervisor reads it: its health answer names the phase (start_server.sh
prints it as its progress line), and an engine that dies before it was ever ready is not restarted:
the supervisor exits and start_server.sh prints this reason. A file, not a socket: the engine's
link to the supervisor exists only once it serves, and the reason must outlive the process.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

STATUS_FILE = "engine.status.json"
LOAD_FAILED = 3  # the exit code of an engine (server or core) whose load failed, and of the supervisor then
REASON_CHARS = 400  # a reason is one line: the first line of the error, cut here


def status_path(log_dir: str | Path) -> Path:
    return Path(log_dir) / STATUS_FILE


def write(log_dir: str | Path, **fields) -> None:
    """Replace the status (whole: a reader never sees half a file). Best effort: a status that cannot
    be written must not stop the engine."""
    path = status_path(log_dir)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps({"pid": os.getpid(), "time": time.time(), **fields}))
        os.replace(tmp, path)
    except OSError:
        pass


def read(log_dir: str | Path) -> dict:
    try:
        return json.loads(status_path(log_dir).read_text())
    except (OSError, ValueError):
        return {}


def clear(log_dir: str | Path) -> None:
    status_path(log_dir).unlink(missing_ok=True)


def one_line(e: BaseException) -> str:
    """An exception as one line: its type (unless the message says what it is) and its first line."""
    first = (str(e).strip().splitlines() or [""])[0]
    text = first if isinstance(e, (RuntimeError, ValueError)) and first else f"{type(e).__name__}: {first}"
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def exit_reason(code: int | None) -> str:
    """Why a process that left no reason ended, from its exit status."""
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        hint = " (out of memory? the kernel's OOM killer sends it: see dmesg)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exited with code {code}"


def fail(log_dir: str | Path, reason: str) -> None:
    """Record why the load failed, unless an earlier writer (the core, for its server) said so first."""
    if not read(log_dir).get("error"):
        write(log_dir, phase="failed", error=reason)


class PhaseHandler(logging.Handler):
    """Writes each INFO (or higher) line logged while the engine starts as its phase."""

    def __init__(self, log_dir: str | Path, who: str) -> None:
        super().__init__(logging.INFO)
        self.log_dir, self.who = log_dir, who

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = (record.getMessage().splitlines() or [""])[0][:REASON_CHARS]
        except Exception:  # noqa: BLE001 - a bad format string must not stop the load
            return
        write(self.log_dir, phase=f"{self.who}: {msg}")


def track(log_dir: str | Path, who: str) -> PhaseHandler:
    """Start writing the phase from the llmserve loggers; remove the handler (untrack) once ready."""
    handler = PhaseHandler(log_dir, who)
    logging.getLogger("llmserve").addHandler(handler)
    return handler


def untrack(handler: PhaseHandler) -> None:
    logging.getLogger("llmserve").removeHandler(handler)
