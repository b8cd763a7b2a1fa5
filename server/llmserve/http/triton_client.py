"""The front end's only way to the engine: one Triton gRPC stream per native request.

`TritonBackend.stream(body)` sends the native JSON body as `IN` on a fresh
bidirectional stream of model `model` and yields each `OUT` JSON object until
the one with `is_end` (or an error). Closing the generator early (client
disconnect) cancels the gRPC call; Triton marks the request cancelled and the
adapter aborts it in the engine, which frees its KV blocks.

Transport failures never escape: they become a native error item (503 when
Triton cannot be reached), so every caller handles one shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Protocol

import numpy as np

from llmserve.protocol.native import error_response
from llmserve.triton.launcher import MODEL_NAME

log = logging.getLogger("llmserve.http")

STREAM_SLACK_S = 30.0  # the engine enforces `timeout`; this only guards against a stuck stream
MAX_STREAM_S = 7 * 24 * 3600.0


class Backend(Protocol):
    def stream(self, body: dict) -> AsyncIterator[dict]: ...

    async def ready(self) -> bool: ...

    async def close(self) -> None: ...


class TritonBackend:
    """Triton gRPC (tritonclient.grpc.aio), created inside the worker's event loop."""

    def __init__(self, url: str, model: str = MODEL_NAME) -> None:
        import tritonclient.grpc.aio as grpcclient

        from llmserve.triton.channel import channel_args

        self._grpc = grpcclient
        self.url = url
        self.model = model
        self.client = grpcclient.InferenceServerClient(url, channel_args=channel_args())

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_model_ready(self.model))
        except Exception:
            return False

    async def close(self) -> None:
        await self.client.close()

    async def stream(self, body: dict) -> AsyncIterator[dict]:
        req_id = body.get("req_id")
        raw = json.dumps(body, ensure_ascii=False).encode()
        inp = self._grpc.InferInput("IN", [1], "BYTES")
        inp.set_data_from_numpy(np.array([raw], dtype=np.object_))
        done = asyncio.Event()

        async def requests():
            yield {"model_name": self.model, "inputs": [inp], "request_id": str(req_id or "")}
            # Keep our side of the stream open until the last response: a decoupled
            # model may answer after the client half-closes, but we do not rely on it.
            await done.wait()

        # Capped: a huge `timeout` (1e308, Infinity) must not overflow the gRPC deadline into "expired".
        timeout = min(float(body.get("timeout") or 300.0), MAX_STREAM_S) + STREAM_SLACK_S
        call = self.client.stream_infer(requests(), stream_timeout=timeout)
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    finished = True
                    yield error_response(req_id, 500, f"Triton: {error}")
                    return
                out = result.as_numpy("OUT")
                if out is None or out.size == 0:  # an empty final response (after a cancel)
                    continue
                item = json.loads(out.reshape(-1)[0])
                last = bool(item.get("is_end")) or bool(item.get("error_code"))
                finished = last
                yield item
                if last:
                    return
            finished = True
            yield error_response(req_id, 500, "Triton closed the stream before the last response")
        except Exception as e:  # grpc.aio.AioRpcError and friends
            finished = True
            code = getattr(e, "code", lambda: None)()
            name = getattr(code, "name", "")
            log.warning("Triton stream for %s failed: %s %s", req_id, name, e)
            status = 503 if name in ("UNAVAILABLE", "") else (408 if name == "DEADLINE_EXCEEDED" else 500)
            details = e.details() if hasattr(e, "details") else str(e)
            yield error_response(
                req_id, status, f"cannot reach the inference server ({name or type(e).__name__}): {details}"
            )
        finally:
            done.set()
            if not finished:
                call.cancel()  # the client went away: Triton cancels the request
