"""The front end's only way to the engine: one long-lived Triton gRPC stream per worker.

`TritonBackend.stream(record)` sends a validated native request's record
(native.record) as msgpack in `IN`, with EDGE_TOKEN in RECORD_PARAM so that the
adapter takes it as checked, and yields each `OUT` JSON object until the one with
`is_end` (or an error). All of a worker's
requests share one bidirectional `ModelStreamInfer` call (`_Mux`): a request is
one message written on it, under a Triton request id of its own, and a reader
task routes the responses to their requests by that id. A call per request cost
the worker ~1.5 ms of CPU to set up (its own HTTP/2 stream, a task writing the
one message, its deadline), which a burst of 64 requests paid before any first
token could leave (docs/benchmarks.md).

Closing a stream early (client disconnect, the guard deadline) cannot cancel a
call that others share, so an abort goes on the same call: a message with the
`llmserve_abort` parameter and the request's `req_id`. The adapter that receives
it has the engine abort the request, which frees its KV blocks, and the engine
ends it at the adapter that owns it (Triton spreads a stream's requests over the
model's instances). Should the abort overtake its request (another instance),
the request's next response sends it again.

Transport failures never escape: they become a native error item (503 when
Triton cannot be reached), so every caller handles one shape. A call that fails
ends every request on it; the next request opens a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import struct
import uuid
from collections.abc import AsyncIterator
from typing import Protocol

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from llmserve.protocol import ABORT_PARAM, RECORD_PARAM
from llmserve.protocol.native import error_response
from llmserve.serving import http_failures as failures
from llmserve.serving import intake_trace
from llmserve.serving.grpc_channel import channel_args
from llmserve.serving.tritonserver import MODEL_NAME
from llmserve.utils.wire import dumps

log = logging.getLogger("llmserve.http")

STREAM_SLACK_S = 30.0  # the engine enforces `timeout`; this only guards against a stuck request
MAX_STREAM_S = 7 * 24 * 3600.0
CLOSE_S = 2.0  # at shutdown: how long Triton may take to end the shared call after we half-close it
_LEN = struct.Struct("<I")  # a BYTES element's length prefix
_TIMED_OUT: dict = {}  # the guard's mark in a request's queue


class Backend(Protocol):
    def stream(self, record: dict) -> AsyncIterator[dict]:
        """The responses of a request validated here: its `native.record`."""
        ...

    async def ready(self) -> bool: ...

    async def close(self) -> None: ...


def _request(model: str, tid: str, raw: bytes, token: str | None = None) -> service_pb2.ModelInferRequest:
    """IN = `raw`: a record (msgpack) under `token`, else (None) an abort's JSON."""
    req = service_pb2.ModelInferRequest(model_name=model, id=tid)
    req.inputs.add(name="IN", datatype="BYTES", shape=[1])
    req.raw_input_contents.append(_LEN.pack(len(raw)) + raw)
    if token is None:
        req.parameters[ABORT_PARAM].bool_param = True
    else:
        req.parameters[RECORD_PARAM].string_param = token
    return req


def _transport_error(e: BaseException) -> tuple[int, str]:
    code = getattr(e, "code", lambda: None)()
    name = getattr(code, "name", "")
    status = 503 if name in ("UNAVAILABLE", "") else (408 if name == "DEADLINE_EXCEEDED" else 500)
    details = e.details() if hasattr(e, "details") else str(e)
    return status, f"cannot reach the inference server ({name or type(e).__name__}): {details}"


class _Mux:
    """One ModelStreamInfer call and its reader and writer tasks; requests routed by Triton request id."""

    def __init__(self, stub: service_pb2_grpc.GRPCInferenceServiceStub, model: str, token: str) -> None:
        self.model = model
        self.token = token
        self.call = stub.ModelStreamInfer()
        self.routes: dict[str, asyncio.Queue] = {}  # tid -> its request's items
        self.abandoned: dict[str, str | None] = {}  # tid -> req_id to abort again (None: sent twice) until its final
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.ids = itertools.count()
        self.prefix = f"{os.getpid()}-{uuid.uuid4().hex[:6]}-"
        self.dead = False
        self.tasks = [asyncio.create_task(self._write()), asyncio.create_task(self._read())]

    def open(self, raw: bytes, req_id: str) -> tuple[str, asyncio.Queue]:
        tid = self.prefix + str(next(self.ids))
        q: asyncio.Queue = asyncio.Queue()
        self.routes[tid] = q
        self.outbox.put_nowait((req_id, _request(self.model, tid, raw, self.token)))
        return tid, q

    def leave(self, tid: str, req_id: str) -> None:
        """The request's reader is gone: if its last item has not come, the engine must drop it."""
        if self.routes.pop(tid, None) is not None and not self.dead:
            self.abandoned[tid] = req_id
            self._abort(req_id)

    def _abort(self, req_id: str) -> None:
        tid = self.prefix + "abort-" + str(next(self.ids))
        raw = json.dumps({"req_id": req_id}, ensure_ascii=False).encode()
        self.outbox.put_nowait((None, _request(self.model, tid, raw)))

    async def _write(self) -> None:
        try:
            while True:
                req_id, msg = await self.outbox.get()  # req_id: None for an abort
                await self.call.write(msg)
                if req_id is not None:
                    intake_trace.mark("http_sent", req_id)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the call failed: the reader sees it too
            log.debug("Triton stream write failed: %s", e)

    async def _read(self) -> None:
        failure: tuple[int, str] = (500, "Triton closed the stream before the last response")
        try:
            while True:
                resp = await self.call.read()
                if resp is grpc.aio.EOF:
                    break
                self._route(resp)
        except asyncio.CancelledError:
            failure = (503, "the server is shutting down")
            raise
        except Exception as e:  # grpc.aio.AioRpcError and friends
            failure = _transport_error(e)
            log.warning("Triton stream failed: %s", failure[1])
        finally:
            self.dead = True
            self.tasks[0].cancel()
            routes, self.routes = self.routes, {}
            self.abandoned.clear()
            for q in routes.values():
                if failure[0] >= 500:  # made here: the engine never saw it fail (serving/http_failures.py)
                    failures.count(failure[0])
                q.put_nowait(error_response(None, *failure))

    def _route(self, resp) -> None:
        res = resp.infer_response
        tid = res.id
        if resp.error_message:
            item = error_response(None, 500, f"Triton: {resp.error_message}")
            failures.count(500)
        elif not res.raw_output_contents:  # an empty final response (a cancelled request's)
            return
        else:
            item = json.loads(res.raw_output_contents[0][_LEN.size :])
        final = bool(item.get("is_end") or item.get("error_code"))
        q = self.routes.pop(tid, None) if final else self.routes.get(tid)
        if q is not None:
            q.put_nowait(item)
            return
        if tid in self.abandoned:  # a request whose reader left
            if final:
                del self.abandoned[tid]
            elif (req_id := self.abandoned[tid]) is not None:  # its abort may have come before it
                self.abandoned[tid] = None
                self._abort(req_id)

    async def close(self) -> None:
        """Half-close the call and let Triton end it: cancelling a stream whose requests have all
        ended leaves Triton holding the model until its exit timeout (docs/serving.md)."""
        writer, reader = self.tasks
        writer.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(self.call.done_writing(), CLOSE_S)
            await asyncio.wait_for(asyncio.shield(reader), CLOSE_S)
        self.call.cancel()
        reader.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class TritonBackend:
    """Triton gRPC (grpc.aio), created inside the worker's event loop."""

    def __init__(self, url: str, token: str = "", model: str = MODEL_NAME) -> None:
        self.url = url
        self.model = model
        self.token = token  # EDGE_TOKEN: the adapter takes our records as checked
        self.channel = grpc.aio.insecure_channel(url, options=channel_args())
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self._mux: _Mux | None = None

    async def ready(self) -> bool:
        try:
            return bool((await self.stub.ModelReady(service_pb2.ModelReadyRequest(name=self.model))).ready)
        except Exception:
            return False

    async def close(self) -> None:
        if self._mux is not None:
            await self._mux.close()
        await self.channel.close()

    def _stream_mux(self) -> _Mux:
        if self._mux is None or self._mux.dead:
            self._mux = _Mux(self.stub, self.model, self.token)
        return self._mux

    async def stream(self, record: dict) -> AsyncIterator[dict]:
        req_id = record["req_id"]
        raw = dumps(record)
        mux = self._stream_mux()
        intake_trace.mark("http", req_id)
        tid, q = mux.open(raw, req_id)
        # Capped: a huge `timeout` (1e308, Infinity) must not overflow the loop's clock.
        timeout = min(float(record["timeout"]), MAX_STREAM_S) + STREAM_SLACK_S
        guard = asyncio.get_running_loop().call_later(timeout, q.put_nowait, _TIMED_OUT)
        first = True
        try:
            while True:
                item = await q.get()
                if item is _TIMED_OUT:
                    yield error_response(req_id, 408, f"no answer from the inference server within {timeout:.0f} s")
                    return
                if item.get("req_id") is None:  # the call's own failure
                    item["req_id"] = req_id
                if first:  # the request's first response: its first token, or its error
                    intake_trace.mark("http_first", req_id)
                    first = False
                yield item
                if item.get("is_end") or item.get("error_code"):
                    return
        finally:
            guard.cancel()
            mux.leave(tid, req_id)  # aborts it unless its last item came
