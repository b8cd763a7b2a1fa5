"""An ASGI app that answers, after a short while, with the pid of the worker that served it
(tests/test_http_workers.py: which worker a connection went to)."""

import asyncio
import os


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await asyncio.sleep(0.2)  # open a while, like a stream before its first token
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": str(os.getpid()).encode()})
