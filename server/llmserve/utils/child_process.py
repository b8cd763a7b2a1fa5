"""A child process that its parent starts, watches, stops and restarts (the supervisor's Triton, engine and
front end), its output appended to a log file or copied to the console line by line."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)


def _copy_lines(src: BinaryIO, dst: BinaryIO, rewrite: Callable[[bytes], bytes], close: bool) -> None:
    try:
        for line in iter(src.readline, b""):
            dst.write(rewrite(line))
            dst.flush()
    except (OSError, ValueError):
        pass  # the destination is gone (console closed, or the supervisor is ending)
    finally:
        src.close()
        if close:
            dst.close()


class Child:
    """A subprocess that the supervisor restarts when it exits.

    Its output goes to log_path (appended: a restarted child's log keeps the lines that explain why),
    or to the console; through `rewrite`, line by line, when given (a pipe and a thread).
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        log_path: Path | None,
        rewrite: Callable[[bytes], bytes] | None = None,
    ) -> None:
        self.name, self.argv, self.env, self.log_path, self.rewrite = name, argv, env, log_path, rewrite
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.started_at = 0.0
        self.restart_at: float | None = None

    def start(self) -> None:
        out = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 (the child, or the copier, owns it)
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if self.rewrite else out,
            stderr=subprocess.STDOUT,
        )
        if self.rewrite:
            dst = out or sys.stdout.buffer
            args = (self.proc.stdout, dst, self.rewrite, out is not None)
            threading.Thread(target=_copy_lines, args=args, name=f"log-{self.name}", daemon=True).start()
        elif out:
            out.close()
        self.started_at = time.monotonic()
        self.restart_at = None
        log.info("started %s (pid %d)", self.name, self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def wait(self, deadline: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in time: killing it", self.name)
            self.proc.kill()
            self.proc.wait()
