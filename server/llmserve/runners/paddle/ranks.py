"""One rank of a Paddle tensor-parallel group: its communicator, then its graph (`rank_<r>`).

An `llmserve export --mp N` holds one static graph per rank whose collectives (`mp_allreduce_sum`,
`all_gather`) run on communicator ring 0 (runners/paddle/export_mp.py). paddle.inference creates that
communicator itself only on GPU builds (NCCL, from rank_mapping.csv); on CPU each rank joins a gloo
process group before its predictor runs, and the graph's CPU kernels use it.

The ranks are llmserve.executor's (rank 0 in the engine core, the others worker processes); they meet on
its torch.distributed store (executor/group.py), which also carries what Paddle needs:
- `paddle/ring`: the process group's id, from rank 0: new for each group its process starts;
- `paddle/store`: host:port of Paddle's own store, which rank 1 opens (a worker, so that the port
  goes with the group; rank 0's process may start another group later: the offline engine).

Not paddle.distributed.init_parallel_env: its store is made once per process, so a second group in
rank 0's process would meet the first one's. Paddle also never releases a process's communicators
and binds its CPU context to the first one a graph uses; an eager all-reduce on the new group binds
it again (and checks the group: every rank adds 1).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time
from dataclasses import dataclass

import paddle
from paddle.base import core

from llmserve.runners.rank_layout import Layout, RendezvousError

log = logging.getLogger(__name__)

_rings = itertools.count()  # rank 0: the id of the next group this process starts


@dataclass(frozen=True)
class PaddleRank:
    """What PaddleRunner needs to load rank `rank` of `world`: its threads and its group."""

    rank: int
    world: int
    per_node: int  # ranks sharing this node's memory
    threads: int  # this rank's share of the node's cores
    group: object  # core.ProcessGroupGloo

    def all_min(self, n: int) -> int:
        """The smallest of every rank's `n` (the KV cache every rank has room for)."""
        t = paddle.to_tensor([n], dtype="int64", place=paddle.CPUPlace())
        self.group.all_reduce(t, core.ReduceOp.MIN, True)
        return int(t.item())


def join_gloo(lay: Layout, rank: int, store, timeout: float, check=None):
    """This rank's Paddle gloo process group, bound for the graphs' collectives (module doc)."""
    os.environ.update(PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(lay.world))  # Paddle reads them
    where = "Paddle's store"
    try:
        if rank == 0:
            store.set("paddle/ring", str(next(_rings)))
        ring = int(store.get("paddle/ring"))
        if rank == 1:
            host = lay.ips[lay.node] if lay.node < len(lay.ips) else lay.master
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            where = f"Paddle's store at {host}:{port}"
            store.set("paddle/store", f"{host}:{port}")
            paddle_store = core.TCPStore(host, port, True, lay.world, max(1, int(timeout)))
        else:
            host, port = store.get("paddle/store").decode().rsplit(":", 1)
            where = f"Paddle's store at {host}:{port}"
            _wait_listening(host, int(port), time.monotonic() + timeout, check, f"{lay.where(1)} never opened {where}")
            paddle_store = core.TCPStore(host, int(port), False, lay.world, max(1, int(timeout)))
        group = core.ProcessGroupGloo.create(paddle_store, rank, lay.world, ring)
        ones = paddle.to_tensor([1], dtype="int32", place=paddle.CPUPlace())
        paddle._C_ops.mp_allreduce_sum_(ones, ring)  # binds the CPU context to this group (module doc)
    except RendezvousError:
        raise
    except Exception as e:  # Paddle's SystemError / ValueError, torch's DistStoreError: "could not meet"
        raise RendezvousError(
            f"{lay.where(rank)} could not join the Paddle gloo group ({where}) within {timeout:.0f} s "
            f"(DIST_TIMEOUT): {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
        ) from None
    if int(ones.item()) != lay.world:
        raise RendezvousError(f"{lay.where(rank)}: Paddle's gloo group counted {int(ones.item())} of {lay.world} ranks")
    log.info("rank %d: Paddle gloo group %d of %d ranks joined", rank, ring, lay.world)
    return group


def _wait_listening(host: str, port: int, deadline: float, check, never: str) -> None:
    """Until rank 1's store accepts connections: Paddle's own client would retry for 15 minutes."""
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            pass
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise RendezvousError(f"{never} (DIST_TIMEOUT)")
        time.sleep(0.05)
