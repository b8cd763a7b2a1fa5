"""How the ranks of a tensor-parallel group find each other (where they run: layout.py).

They meet at a torch.distributed TCP store on POD_0_IP:DIST_PORT (rank 0 opens it), then join one
process group (NCCL on CUDA, gloo on CPU). Nobody waits for ever:
a rank that cannot reach the store, or a store that misses ranks, fails after DIST_TIMEOUT with a
message naming the nodes and the address.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch.distributed as dist

from llmserve.kernels.switches import Switches
from llmserve.layers.parallel import TensorParallel, with_one_shot
from llmserve.runners.rank_layout import Layout, RendezvousError

log = logging.getLogger(__name__)


def join(
    lay: Layout, rank: int, timeout: float, cuda: bool, kernels: Switches, check=None
) -> tuple[TensorParallel, dist.TCPStore]:
    """Meet the other ranks and join the process group (NCCL when `cuda`, else gloo). `check()`, called
    while rank 0 waits, raises when a rank it started died meanwhile. `kernels`: the
    config's kernel switches (kernels/switches.py: tp_fused_norm, tp_gemv_push)."""
    where = f"{lay.master}:{lay.port}"
    try:
        store = dist.TCPStore(
            lay.master, lay.port, lay.world, rank == 0, timedelta(seconds=timeout), wait_for_workers=False
        )
    except Exception as e:  # DistNetworkError, DistStoreError, RuntimeError: all "could not meet"
        what = "open" if rank == 0 else "reach"
        raise RendezvousError(
            f"{lay.where(rank)} could not {what} the rendezvous at {where} (POD_0_IP:DIST_PORT) "
            f"within {timeout:.0f} s (DIST_TIMEOUT): {e}"
        ) from None
    store.set(f"joined/{rank}", "1")
    if rank == 0:
        deadline = time.monotonic() + timeout
        while True:
            missing = [r for r in range(1, lay.world) if not store.check([f"joined/{r}"])]
            if not missing:
                break
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"waited {timeout:.0f} s (DIST_TIMEOUT) at {where} for {', '.join(map(lay.where, missing))}: "
                    "never arrived; is start_server.sh running on that node with the same MP_NUM, MP_NNODE, "
                    "POD_IPS and DIST_PORT?"
                )
            time.sleep(0.05)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=lay.world, timeout=timedelta(seconds=timeout))
    tp = TensorParallel(rank, lay.world, dist.group.WORLD)
    if cuda and lay.nodes == 1:  # NVLink peers: small sums (decode steps) in one kernel
        tp = with_one_shot(tp, kernels.tp_fused_norm, kernels.tp_gemv_push)
        how = "one-shot" if tp.one_shot else "NCCL"
        fused = ", fused with the norm after them" if tp.fused_norm else ""
        log.info("rank %d: sums up to %d KB %s%s", rank, tp.one_shot_bytes >> 10, how, fused)
    return tp, store
