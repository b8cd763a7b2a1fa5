"""The supervisor's SIGTERM handler takes no lock.

Python runs a signal handler in the main thread between two bytecodes, so also while that thread holds
a lock, as it does inside its own `Event.wait`. A handler that called `Event.set` on that Event then
waited on its own thread forever: in CI a stop hung for 30 s, until stop_server.sh's SIGKILL.
"""

from __future__ import annotations

import threading

from llmserve.config import Config
from llmserve.serving.supervisor import Supervisor


def test_stop_signal_handler_runs_where_the_main_thread_holds_the_stop_event_lock():
    sup = Supervisor(Config.from_env())
    done = threading.Event()

    def main_thread_in_its_wait() -> None:
        with sup.stopping._cond:  # what Event.wait holds between its checks (a non-reentrant Lock)
            sup.on_signal()  # the signal lands here
        done.set()

    threading.Thread(target=main_thread_in_its_wait, daemon=True).start()
    assert done.wait(5), "the handler blocked on a lock its own thread holds"
    assert sup.stop_asked and not sup.stopping.is_set()  # the main loop sets `stopping` when it leaves
