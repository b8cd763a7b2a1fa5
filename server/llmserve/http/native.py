"""The native protocol over HTTP: POST /v1/chat/completions with `text` | `messages` | `input_ids`.

The body is validated here, once (so bad input never reaches Triton), and
its record (native.record) goes on. Streaming answers one JSON object per line
(NDJSON) exactly as the engine sends them; non-streaming answers one object.
Errors before the first token (validation, admission: 409, 413, 429, ...)
get their own HTTP status; an error mid-stream is the stream's last line.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from llmserve.http.disconnect import until_disconnected
from llmserve.http.errors import ApiError, native_error, status_of
from llmserve.http.streaming import StreamResponse
from llmserve.http.triton_client import Backend
from llmserve.protocol import native

NDJSON = "application/x-ndjson"


def parse_native(body: dict) -> tuple[native.NativeRequest, dict]:
    """The request and its record, checked by the shared rules (once): a bad body is answered here."""
    try:
        req = native.parse(body)
        return req, native.record(req)
    except native.NativeError as e:
        raise ApiError(e.code, e.msg, e.param) from None


def _line(item: dict) -> bytes:
    return (json.dumps(item, ensure_ascii=False) + "\n").encode()


async def handle_native(request: Request, body: dict, backend: Backend) -> Response:
    req, rec = parse_native(body)
    gen = backend.stream(rec)
    try:
        first = await anext(gen)
    except BaseException:
        await gen.aclose()
        raise
    if first.get("error_code"):
        await gen.aclose()
        return JSONResponse(first, status_code=status_of(first["error_code"]))
    if req.stream:
        return StreamResponse(_ndjson(first, gen), media_type=NDJSON)
    result = await until_disconnected(request, _collect(first, gen))
    if result is None:  # the client left; nobody reads this
        return Response(status_code=499)
    return JSONResponse(result, status_code=status_of(result["error_code"]) if result.get("error_code") else 200)


async def _ndjson(first: dict, gen: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(gen):
        yield _line(first)
        if first.get("is_end"):
            return
        async for item in gen:
            yield _line(item)


async def _collect(first: dict, gen: AsyncIterator[dict]) -> dict:
    """The whole answer as one native object (or the error that ended it)."""
    token_ids: list[int] = []
    logprobs: list[dict] = []
    item = first
    async with contextlib.aclosing(gen):
        while True:
            if item.get("error_code"):
                return native_error(item["error_code"], item.get("error_msg", ""), item.get("req_id"))
            token_ids += item.get("token_ids") or []
            logprobs += item.get("logprobs") or []
            if item.get("is_end"):
                break
            item = await anext(gen)
    text = item.get("tokens_all", "")
    out = {
        "req_id": item.get("req_id"),
        "result": text,
        "tokens_all": text,
        "token_ids": token_ids,
        "is_end": 1,
        "finish_reason": item.get("finish_reason"),
        "error_msg": "",
        "error_code": 0,
    }
    if "usage" in item:
        out["usage"] = item["usage"]
    if logprobs:
        out["logprobs"] = logprobs
    return out
