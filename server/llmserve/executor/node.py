"""A node other than 0 (MP_NNODE > 1): this node's ranks, started again whenever their group fails.

start_server.sh runs this instead of the serving stack on such a node. Its workers (worker.py) meet
rank 0 on node 0 (group.py). When any of them exits (a rank died, or rank 0's heartbeat stopped:
node 0 restarted its engine), the launcher stops the others and starts them all again, so that they
meet the new rank 0. SIGTERM (stop_server.sh) stops it and them; they also die with it.

Run: `python -m llmserve.executor.node`.
"""

from __future__ import annotations

import logging
import signal
import time

from llmserve.config import Config
from llmserve.executor.workers import Workers
from llmserve.runners.rank_layout import layout

log = logging.getLogger("llmserve.node")

RESTART_DELAY_S = 1.0


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = Config.from_env()
    lay = layout(config)
    stopping = False

    def stop(*_) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    ranks = list(lay.node_ranks())
    while not stopping:
        log.info("node %d: starting ranks %s; rank 0 at %s:%d", lay.node, ranks, lay.master, lay.port)
        workers = Workers(ranks)
        while not stopping and workers.dead() is None:
            time.sleep(0.2)
        if not stopping:
            rank, code = workers.dead()
            log.error("%s exited with code %s: restarting this node's ranks", lay.where(rank), code)
        for p in workers.procs.values():
            p.terminate()
        workers.stop(timeout=10.0)
        if not stopping:
            time.sleep(RESTART_DELAY_S)
    log.info("node %d stopped", lay.node)


if __name__ == "__main__":
    main()
