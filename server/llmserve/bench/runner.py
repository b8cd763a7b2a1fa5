"""The load loop: send a workload at a request rate, under a concurrency cap."""

from __future__ import annotations

import asyncio
import time
import uuid

from llmserve.bench.backends import Backend
from llmserve.bench.metrics import RequestResult
from llmserve.bench.workload import BenchRequest, arrival_delays


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

    delays = arrival_delays(len(requests), request_rate, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    run_id = uuid.uuid4().hex[:8]  # req_ids stay unique across runs against one server
    bar = tqdm(total=len(requests), desc=desc, unit="req", disable=not progress, leave=False)

    async def one(i: int, req: BenchRequest) -> RequestResult:
        rid = f"bench-{run_id}-{i}"
        if sem is None:
            res = await backend.send(req, rid)
        else:
            async with sem:
                res = await backend.send(req, rid)
        bar.update()
        return res

    start = time.perf_counter()
    tasks = []
    for i, (req, delay) in enumerate(zip(requests, delays)):
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, req)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


async def warmup(backend: Backend, requests: list[BenchRequest], n: int) -> list[RequestResult]:
    """Send `n` requests one at a time (not measured): first-call costs stay out of the figures."""
    return [await backend.send(requests[i % len(requests)], f"warmup-{uuid.uuid4().hex[:8]}-{i}") for i in range(n)]
