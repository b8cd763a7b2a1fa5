"""A worker rank (1 .. MP_NUM - 1) of a tensor-parallel group: run every step rank 0 sends.

It meets the group (group.py), says hello on rank 0's step channel, loads its shard and then, step
after step, turns the message back into a batch (step_message.py) and runs it: the same forward and
sampling as rank 0, whose result is the one used. A heartbeat thread beats every HEARTBEAT_S and
ends the process when rank 0's beats stop (rank 0 died or hung): no rank outlives its group.

Run: `python -m llmserve.executor.worker RANK` (rank 0's executor or a node's launcher starts it).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import torch
import zmq

from llmserve.config import Config
from llmserve.engine.heap import freeze_startup_objects
from llmserve.executor.executor import HEARTBEAT_S, RankModel, threads_per_rank
from llmserve.executor.group import join
from llmserve.executor.step_message import StepDecoder
from llmserve.kernels import switches
from llmserve.runners.model_dir import resolve_model_dir
from llmserve.runners.rank_layout import layout
from llmserve.utils.process import die_with_parent, exit_now

log = logging.getLogger("llmserve.worker")


def _heartbeat(address: str, rank: int, ctx: zmq.Context, timeout: float) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send(str(rank).encode())
    last = time.monotonic()
    while True:
        if sock.poll(int(HEARTBEAT_S * 1000)):
            while sock.poll(0):
                sock.recv()
            last = time.monotonic()
        sock.send(b"hb")
        if time.monotonic() - last > timeout:
            log.error("rank %d: no heartbeat from rank 0 for %g s; exiting", rank, timeout)
            os._exit(1)


def main() -> None:
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: rank 0 stops us
    rank = int(sys.argv[1])
    config = Config.from_env()
    lay = layout(config)
    model = RankModel(str(resolve_model_dir(config)), config)
    cuda = model.cuda
    if cuda:
        torch.cuda.set_device(rank % lay.per_node)
    else:
        torch.set_num_threads(threads_per_rank(lay))
    tp, store = join(lay, rank, config.dist_timeout, cuda, switches.parse(config.kernel_switches))
    ctx = zmq.Context.instance()
    steps = ctx.socket(zmq.DEALER)
    steps.setsockopt(zmq.LINGER, 0)
    steps.connect(store.get("steps").decode())
    steps.send_multipart([b"hello", str(rank).encode()])
    hb_addr = store.get("heartbeat").decode()
    threading.Thread(target=_heartbeat, args=(hb_addr, rank, ctx, config.dist_heartbeat_timeout), daemon=True).start()
    runner = model.runner(lay, rank, tp, store)
    freeze_startup_objects()
    log.info("rank %d ready: %d KV blocks", rank, runner.num_kv_blocks)
    decoder = StepDecoder()
    with torch.inference_mode():
        while True:
            op, msg = steps.recv_multipart()
            if op == b"stop":
                break
            runner.submit(decoder.decode(msg))
    runner.shutdown()
    torch.distributed.destroy_process_group()
    exit_now(0)


if __name__ == "__main__":
    main()
