"""One level's requests split over several client processes (`--client-processes N`).

At high concurrency a single asyncio client saturates its core (`client_cpu_share` near 1): the
client, not the server, then paces the sends and stream reads, and TTFT grows. Here each process
runs the load loop (`runner.send_at`) on its share with its own backend client:

- request i goes to process (i mod c) mod w, with w = min(N, c, requests) processes and caps that
  sum to c (c // w, one more for the first c % w): round-robin when w divides c, otherwise shares
  in proportion to the caps; without a cap, i mod N and no caps;
- each request keeps its send time of the whole workload (offset from the start), so the aggregate
  arrival process is that of one client at --request-rate;
- every process builds its backend (imports, tokenizer, connections) before a common start, so the
  measured time runs from the start to the last process's end.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from llmserve.bench.backends import Backend, make_backend
from llmserve.bench.metrics import RequestResult
from llmserve.bench.runner import send_at
from llmserve.bench.workload import BenchRequest, Vocab

READY_TIMEOUT_S = 300.0  # for every process to build its backend


class ClientProcessError(RuntimeError):
    """A client process failed (its traceback in the message) or died."""


@dataclass(frozen=True)
class ClientSpec:
    """A served backend, as another process builds it (a Vocab does not pickle: its chat template)."""

    backend: str
    host: str
    port: int
    tokenizer: str  # directory
    temperature: float = 0.0
    timeout: float = 300.0

    def build(self, vocab: Vocab | None = None) -> Backend:
        if vocab is None:
            from llmserve.engine.tokenizer import load_tokenizer

            vocab = Vocab(load_tokenizer(self.tokenizer))
        kw = {"temperature": self.temperature, "timeout": self.timeout}
        return make_backend(self.backend, self.host, self.port, vocab, **kw)


def split(num: int, procs: int, conc: int | None) -> list[tuple[list[int], int | None]]:
    """(request indices, concurrency cap) per process; see the module's docstring."""
    w = max(1, min(procs, num, conc or procs))
    owner = [(i % conc if conc else i) % w for i in range(num)]
    caps = [conc // w + (k < conc % w) if conc else None for k in range(w)]
    return [([i for i in range(num) if owner[i] == k], caps[k]) for k in range(w)]


def run_processes(
    spec: ClientSpec,
    requests: list[BenchRequest],
    offsets: list[float],
    conc: int | None,
    procs: int,
    progress: bool = True,
    desc: str = "bench",
) -> tuple[list[RequestResult], float, list[float]]:
    """One level over client processes: the results in request order, the wall time (first start to
    last end) and each process's CPU seconds over its run. A process's error raises ClientProcessError."""
    from tqdm import tqdm

    ctx = mp.get_context("spawn")  # no fork of the parent's event loop, sessions and threads
    shares = split(len(requests), procs, conc)
    go, count = ctx.Event(), ctx.Value("i", 0)
    workers: list[tuple[BaseProcess, Connection]] = []
    bar = tqdm(total=len(requests), desc=desc, unit="req", disable=not progress, leave=False)
    try:
        for k, (ids, cap) in enumerate(shares):
            recv, send = ctx.Pipe(duplex=False)
            share = ([requests[i] for i in ids], [offsets[i] for i in ids], ids, cap)
            p = ctx.Process(target=_worker, args=(spec, *share, go, count, send), name=f"bench-client-{k}")
            p.daemon = True  # terminated at the parent's exit, should the cleanup below be skipped
            p.start()
            send.close()  # the parent's copy: the worker's death then reads as EOF
            workers.append((p, recv))
        _collect(workers, "ready", READY_TIMEOUT_S)
        go.set()
        done = _collect(workers, "done", None, lambda: bar.update(count.value - bar.n))
    except BaseException:  # an error, or Ctrl-C (the workers ignore SIGINT): the rest is not wanted
        for p, _ in workers:
            p.terminate()
        raise
    finally:
        bar.close()
        for p, conn in workers:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
            conn.close()
    by_index = {i: r for (ids, _), (res, *_) in zip(shares, done) for i, r in zip(ids, res)}
    results = [by_index[i] for i in range(len(requests))]
    duration = max(d[2] for d in done) - min(d[1] for d in done)  # perf_counter: one clock system-wide
    return results, duration, [d[3] for d in done]


def _collect(
    workers: list[tuple[BaseProcess, Connection]],
    kind: str,
    timeout: float | None,
    tick: Callable[[], object] | None = None,
) -> list[Any]:
    """Every worker's next message, which must be `kind`; a worker's error or death raises."""
    pending = {conn: k for k, (_, conn) in enumerate(workers)}
    got: dict[int, Any] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        for conn in wait(list(pending), timeout=0.2):
            k = pending.pop(conn)
            try:
                tag, payload = conn.recv()
            except EOFError:
                p = workers[k][0]
                p.join(1)
                raise ClientProcessError(f"bench client process {p.name} exited (code {p.exitcode})") from None
            if tag != kind:
                raise ClientProcessError(f"bench client process {workers[k][0].name} failed:\n{payload}")
            got[k] = payload
        if tick is not None:
            tick()
        if deadline is not None and time.monotonic() > deadline:
            raise ClientProcessError(f"bench client processes not {kind} after {timeout:.0f} s")
    return [got[k] for k in range(len(workers))]


def _worker(
    spec: ClientSpec,
    requests: list[BenchRequest],
    offsets: list[float],
    ids: list[int],
    cap: int | None,
    go: Any,
    count: Any,
    out: Connection,
) -> None:
    # Ctrl-C goes to the whole process group: the parent handles it and ends the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        out.send(("done", asyncio.run(_work(spec, requests, offsets, ids, cap, go, count, out))))
    except BaseException:
        out.send(("error", traceback.format_exc()))
    finally:
        out.close()


async def _work(
    spec: ClientSpec,
    requests: Sequence[BenchRequest],
    offsets: Sequence[float],
    ids: Sequence[int],
    cap: int | None,
    go: Any,
    count: Any,
    out: Connection,
) -> tuple[list[RequestResult], float, float, float]:
    parent = mp.parent_process()
    assert parent is not None
    # A parent killed outright (no cleanup) ends us too: its sentinel reads as EOF.
    asyncio.get_running_loop().add_reader(parent.sentinel, os._exit, 1)
    backend = spec.build()
    await backend.start()
    try:
        out.send(("ready", None))
        # Blocks the event loop on purpose: nothing is to run before the common start.
        while not go.wait(0.5):
            if not parent.is_alive():
                raise RuntimeError("the parent process is gone")

        def done() -> None:
            with count.get_lock():
                count.value += 1

        start, cpu = time.perf_counter(), time.process_time()
        results = await send_at(backend, requests, offsets, cap, ids, done)
        return results, start, time.perf_counter(), time.process_time() - cpu
    finally:
        await backend.close()
