"""Rank 0 of a tensor-parallel group: the executor the engine drives like a runner.

`submit` sends the step's message (step_message.py) to every other rank, then launches the step on
its own shard; the collectives inside the model keep the ranks in step, and rank 0's tokens are the
result (every rank samples the same ones). With MP_NUM=1 the engine gets the runner itself: no
executor, no message, no hop. A rank's runner is that of the model's format (`RankModel`): its shard
of an HF checkpoint (torch runner), or its graph `rank_<r>` of a Paddle export (runners/paddle/ranks.py,
on CPU over gloo).

Rank 0 starts the workers of its own node (worker.py; they die with it) and watches every rank:
a worker process that exits, or a rank whose heartbeat stops (DIST_HEARTBEAT_TIMEOUT), ends this whole
process at once. The engine server then fails the requests in flight, readiness goes false, and the
supervisor restarts the group: workers on other nodes see rank 0's heartbeat stop, exit, and their
node's launcher (node.py) starts them again to meet the new rank 0.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import zmq

from llmserve.config import Config
from llmserve.engine.runner_contract import ModelRunner, StepBatch, StepResult
from llmserve.executor.group import join
from llmserve.executor.step_message import StepEncoder
from llmserve.executor.workers import Workers
from llmserve.kernels import switches
from llmserve.layers.model_config import ModelConfig
from llmserve.layers.parallel import check_shardable
from llmserve.runners.model_dir import runner_kind
from llmserve.runners.rank_layout import Layout, RendezvousError, layout
from llmserve.runners.torch.runner import TorchRunner, pick_device

if TYPE_CHECKING:
    from llmserve.runners.paddle.runner import PaddleRunner

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
EXIT_CODE = 75  # this process ends itself: a rank of its group failed


def threads_per_rank(lay: Layout) -> int:
    """CPU threads of each rank of this node: its cores shared, not oversubscribed."""
    return max(1, (os.cpu_count() or 1) // lay.per_node)


class RankModel:
    """What every rank loads of MODEL_DIR: the runner of its format (loader.runner_kind), on its device."""

    def __init__(self, model_dir: str, config: Config) -> None:
        self.model_dir, self.config = model_dir, config
        self.paddle = runner_kind(model_dir, config) == "paddle"
        self.cuda = not self.paddle and pick_device(config).type == "cuda"  # Paddle ranks: CPU, gloo

    def check(self, lay: Layout) -> None:
        """Before any worker starts: what this group cannot serve, named."""
        if self.paddle:
            from llmserve.runners.paddle.runner import check_config

            check_config(Path(self.model_dir), self.config)
        else:
            mc = ModelConfig.from_file(self.config.model_config_path or f"{self.model_dir}/config.json")
            check_shardable(mc, lay.world)

    def runner(self, lay: Layout, rank: int, tp, store, check=None) -> ModelRunner:
        """Rank `rank`'s runner; `tp` and `store` from group.join."""
        if self.paddle:
            return load_paddle_rank(self.model_dir, self.config, lay, rank, store, threads_per_rank(lay), check)
        return TorchRunner(self.model_dir, self.config, tp)


class TPExecutor(ModelRunner):
    def __init__(
        self, runner: ModelRunner, lay: Layout, channels: _Channels, workers: Workers, stop: threading.Event
    ) -> None:
        self.runner, self.layout, self.workers, self._stop = runner, lay, workers, stop
        for name in (
            "block_size",
            "num_kv_blocks",
            "max_model_len",
            "eos_token_ids",
            "vocab_size",
            "overlap",
            "asynchronous",
        ):
            setattr(self, name, getattr(runner, name))
        self.default_long_prefill_tokens = runner.default_long_prefill_tokens
        self.saturation_tokens, self.max_sampled_rows = runner.saturation_tokens, runner.max_sampled_rows
        self.encoder = StepEncoder()
        self.steps, self.peers = channels.steps_sock, channels.peers

    # ---- the runner contract ----------------------------------------------------
    def submit(self, batch: StepBatch) -> object:
        msg = self.encoder.encode(batch)
        for peer in self.peers:
            self.steps.send_multipart([peer, b"step", msg])
        try:
            return self.runner.submit(batch)
        except Exception:
            self._fail_if_a_worker_died()
            raise

    def result(self, handle: object) -> StepResult:
        try:
            return self.runner.result(handle)
        except Exception:
            self._fail_if_a_worker_died()
            raise

    def done(self, handle: object) -> bool:
        return self.runner.done(handle)

    def _fail_if_a_worker_died(self) -> None:
        """A collective fails at once when a rank's process is gone (gloo: connection reset): end the
        group as the monitor would a moment later, rather than raise a bare `std::exception`."""
        deadline = time.monotonic() + HEARTBEAT_S
        while time.monotonic() < deadline and not self._stop.is_set():
            dead = self.workers.dead()
            if dead is not None:
                _fail(self.workers, f"{self.layout.where(dead[0])} exited with code {dead[1]}")
            time.sleep(0.02)

    def execute(self, batch: StepBatch) -> StepResult:
        return self.result(self.submit(batch))

    def shutdown(self) -> None:
        """Every rank leaves together: the process group's teardown (NCCL) waits for the others."""
        self._stop.set()
        for peer in self.peers:
            self.steps.send_multipart([peer, b"stop", b""])
        self.runner.shutdown()
        self.runner = None  # it holds the process group, which holds the rendezvous store and its port
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self.workers.stop()
        self.steps.close(0)


class _Channels:
    """Rank 0's sockets: steps out (ROUTER, the engine's thread) and heartbeats (the monitor's)."""

    def __init__(self, lay: Layout, store, ctx: zmq.Context) -> None:
        self.steps_sock = ctx.socket(zmq.ROUTER)
        self.steps_sock.setsockopt(zmq.LINGER, 0)
        port = self.steps_sock.bind_to_random_port(f"tcp://{lay.master}")
        self.hb_sock = ctx.socket(zmq.ROUTER)
        self.hb_sock.setsockopt(zmq.LINGER, 0)
        hb_port = self.hb_sock.bind_to_random_port(f"tcp://{lay.master}")
        store.set("steps", f"tcp://{lay.master}:{port}")
        store.set("heartbeat", f"tcp://{lay.master}:{hb_port}")
        self.peers: list[bytes] = []

    def wait_hellos(self, lay: Layout, timeout: float, check) -> None:
        """Every worker's hello on the step channel (its routing id), in rank order."""
        got: dict[int, bytes] = {}
        deadline = time.monotonic() + timeout
        while len(got) < lay.world - 1:
            if self.steps_sock.poll(100):
                peer, _, rank = self.steps_sock.recv_multipart()
                got[int(rank)] = peer
            check()
            if time.monotonic() > deadline:
                missing = [lay.where(r) for r in range(1, lay.world) if r not in got]
                raise RendezvousError(f"no hello on the step channel from {', '.join(missing)}")
        self.peers = [got[r] for r in sorted(got)]


def _monitor(
    lay: Layout, hb: zmq.Socket, peers_by_rank: dict[bytes, int], workers: Workers, stop, timeout: float
) -> None:
    """Heartbeats both ways; any rank gone or silent for `timeout` s ends this process (module doc)."""
    last = {r: time.monotonic() for r in range(1, lay.world)}
    while not stop.is_set():
        while hb.poll(0):
            peer, _ = hb.recv_multipart()
            if peer not in peers_by_rank:
                continue
            last[peers_by_rank[peer]] = time.monotonic()
        for peer in peers_by_rank:
            try:
                hb.send_multipart([peer, b"hb"], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        now = time.monotonic()
        why = None
        dead = workers.dead()
        if dead is not None:
            why = f"{lay.where(dead[0])} exited with code {dead[1]}"
        else:
            silent = [r for r, t in last.items() if now - t > timeout]
            if silent:
                why = f"no heartbeat for {timeout:g} s from {', '.join(map(lay.where, silent))}"
        if why and not stop.is_set():
            _fail(workers, why)
        stop.wait(HEARTBEAT_S / 2)
    hb.close(0)


def _fail(workers: Workers, why: str) -> None:
    log.error("tensor-parallel group failed: %s; stopping every rank", why)
    for p in workers.procs.values():
        p.kill()
    os._exit(EXIT_CODE)


def start_executor(model_dir: str, config: Config) -> TPExecutor:
    """Start this node's workers, meet every rank, load rank 0's shard: the engine's executor."""
    lay = layout(config)
    model = RankModel(model_dir, config)
    model.check(lay)
    cuda = model.cuda
    if not cuda:
        torch.set_num_threads(threads_per_rank(lay))
    workers = Workers(list(lay.node_ranks())[1:], env={**os.environ, **config.to_env()})  # this exact config

    def check() -> None:
        dead = workers.dead()
        if dead is not None:
            raise RendezvousError(f"{lay.where(dead[0])} exited with code {dead[1]} while starting")

    stop = threading.Event()  # set: the monitor stands down (shutdown, or a start that failed)
    try:
        tp, store = join(lay, 0, config.dist_timeout, cuda, switches.parse(config.kernel_switches), check)
        ch = _Channels(lay, store, zmq.Context.instance())
        ch.wait_hellos(lay, config.dist_timeout, check)
        # Heartbeat ids: each worker says hello on it with its rank first.
        by_rank: dict[bytes, int] = {}
        deadline = time.monotonic() + config.dist_timeout
        while len(by_rank) < lay.world - 1 and time.monotonic() < deadline:
            if ch.hb_sock.poll(100):
                peer, rank = ch.hb_sock.recv_multipart()
                by_rank[peer] = int(rank)
            check()
        monitor_args = (lay, ch.hb_sock, by_rank, workers, stop, config.dist_heartbeat_timeout)
        threading.Thread(target=_monitor, args=monitor_args, daemon=True).start()
        log.info("tensor parallel: %d ranks on %d node(s) met at %s:%d", lay.world, lay.nodes, lay.master, lay.port)
        runner = model.runner(lay, 0, tp, store, check)
    except BaseException:
        stop.set()
        for p in workers.procs.values():
            p.kill()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        raise
    return TPExecutor(runner, lay, ch, workers, stop)


def load_paddle_rank(
    model_dir: str, config: Config, lay: Layout, rank: int, store, threads: int, check=None
) -> PaddleRunner:
    """Join the group's Paddle communicator, then load graph rank_<rank>. `store`: the rendezvous
    store (group.join); `check()` raises when a rank that rank 0 started died meanwhile."""
    from llmserve.engine.sampler import Sampler
    from llmserve.runners.paddle.ranks import PaddleRank, join_gloo
    from llmserve.runners.paddle.runner import PaddleRunner

    group = join_gloo(lay, rank, store, config.dist_timeout, check)
    return PaddleRunner(
        model_dir, config, Sampler(config.seed), PaddleRank(rank, lay.world, lay.per_node, threads, group)
    )
