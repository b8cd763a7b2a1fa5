"""The worker processes of one node (no torch here: a node's launcher only starts and watches them)."""

from __future__ import annotations

import subprocess
import sys
import time


class Workers:
    """The worker processes of this node (ranks other than 0), started with `argv` + their rank."""

    def __init__(self, ranks: list[int], env: dict[str, str] | None = None) -> None:
        argv = [sys.executable, "-m", "llmserve.executor.worker"]
        self.procs = {r: subprocess.Popen([*argv, str(r)], env=env, stdin=subprocess.DEVNULL) for r in ranks}

    def dead(self) -> tuple[int, int] | None:
        """(rank, exit code) of a worker that exited, if any."""
        for r, p in self.procs.items():
            if p.poll() is not None:
                return r, p.returncode
        return None

    def stop(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
