"""The load loop: send a workload at a request rate, under a concurrency cap."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence

from llmserve.bench.backends import Backend
from llmserve.bench.metrics import RequestResult
from llmserve.bench.workload import BenchRequest, arrival_offsets


async def run_level(
    backend: Backend,
    requests: list[BenchRequest],
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    seed: int = 0,
    progress: bool = True,
    desc: str = "bench",
) -> tuple[list[RequestResult], float]:
    """Send every request once; return one result per request (in order) and the wall time."""
    from tqdm import tqdm

    offsets = arrival_offsets(len(requests), request_rate, seed)
    bar = tqdm(total=len(requests), desc=desc, unit="req", disable=not progress, leave=False)
    start = time.perf_counter()
    results = await send_at(backend, requests, offsets, max_concurrency, on_done=bar.update)
    duration = time.perf_counter() - start
    bar.close()
    return results, duration


async def send_at(
    backend: Backend,
    requests: Sequence[BenchRequest],
    offsets: Sequence[float],
    max_concurrency: int | None = None,
    ids: Sequence[int] | None = None,
    on_done: Callable[[], object] | None = None,
) -> list[RequestResult]:
    """Send requests[k] offsets[k] s after the call, at most `max_concurrency` in flight; the results
    in order. `ids` number the requests in their req_ids (a client process's share of a workload)."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    run_id = uuid.uuid4().hex[:8]  # req_ids stay unique across runs against one server

    async def one(i: int, req: BenchRequest) -> RequestResult:
        rid = f"bench-{run_id}-{i}"
        if sem is None:
            res = await backend.send(req, rid)
        else:
            async with sem:
                res = await backend.send(req, rid)
        if on_done is not None:
            on_done()
        return res

    start = time.perf_counter()
    tasks = []
    # Absolute send times, not gaps: a late wake-up does not push back every later arrival.
    for i, req, offset in zip(ids or range(len(requests)), requests, offsets):
        if (wait := start + offset - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(i, req)))
    return list(await asyncio.gather(*tasks))


async def warmup(backend: Backend, requests: list[BenchRequest], n: int) -> list[RequestResult]:
    """Send `n` requests one at a time (not measured): first-call costs stay out of the figures."""
    return [await backend.send(requests[i % len(requests)], f"warmup-{uuid.uuid4().hex[:8]}-{i}") for i in range(n)]
