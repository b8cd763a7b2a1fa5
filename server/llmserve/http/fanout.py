"""Run several native requests (OpenAI `n`, list prompts) as one stream of (index, item).

Each request has its own Triton stream in its own task; items arrive in the
order they are produced. Closing the merged stream (client gone) cancels the
tasks, and each task's generator cancels its gRPC call on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from llmserve.http.triton_client import Backend
from llmserve.protocol.native import error_response

_DONE = object()


async def fanout(backend: Backend, bodies: list[dict]) -> AsyncIterator[tuple[int, dict]]:
    if len(bodies) == 1:  # the common case: no tasks, no queue
        async with contextlib.aclosing(backend.stream(bodies[0])) as gen:
            async for item in gen:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, body: dict) -> None:
        try:
            async with contextlib.aclosing(backend.stream(body)) as gen:
                async for item in gen:
                    await queue.put((i, item))
        except Exception as e:  # a bug: end this choice with an error, not the whole response
            await queue.put((i, error_response(body.get("req_id"), 500, f"internal error: {e}")))
        finally:
            queue.put_nowait(_DONE)

    tasks = [asyncio.create_task(pump(i, b)) for i, b in enumerate(bodies)]
    try:
        left = len(tasks)
        while left:
            got = await queue.get()
            if got is _DONE:
                left -= 1
                continue
            yield got
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def first_of(backend: Backend, bodies: list[dict]) -> tuple[tuple[int, dict], AsyncIterator[tuple[int, dict]]]:
    """The fanned-out streams' first item, and the merged stream for the rest; the stream is closed when the
    first is an error (its caller answers that) or raises."""
    merged = fanout(backend, bodies)
    try:
        first = await anext(merged)
    except BaseException:
        await merged.aclose()
        raise
    if first[1].get("error_code"):
        await merged.aclose()
    return first, merged
