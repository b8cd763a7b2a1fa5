"""Stop work for a client that hung up.

Streaming responses need nothing here: StreamResponse (streaming.py) cancels the body iterator
when the client disconnects, and closing it cancels the gRPC streams. A
non-streaming handler only awaits a result, so it races that against the
ASGI `http.disconnect` message and cancels the work when the client leaves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """The result of `work`, or None (with `work` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()
