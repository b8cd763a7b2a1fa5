"""OpenAI protocol over HTTP: /v1/completions and /v1/chat/completions.

Each choice is one native request to Triton (see protocol/openai.py); the
engine's items become OpenAI objects here. Streaming is SSE: one chunk per
engine item (the last one carries `finish_reason`), an optional usage chunk
(`stream_options.include_usage`), then `data: [DONE]`.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmserve.config import Config
from llmserve.http.disconnect import until_disconnected
from llmserve.http.errors import ApiError, openai_error, status_of
from llmserve.http.fanout import fanout
from llmserve.http.tokens import get_tokenizer
from llmserve.http.triton_client import Backend
from llmserve.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIValidationError,
    parse_chat,
    parse_completion,
)

SSE = "text/event-stream"


@dataclass
class Choice:
    """What one choice has produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    started: bool = False
    prefix_len: int = 0  # echoed prompt characters at the start of `text`


class _Call:
    """One OpenAI request in flight: its native bodies, choices and response framing."""

    def __init__(self, req: CompletionRequest | ChatCompletionRequest, config: Config) -> None:
        self.req = req
        self.config = config
        self.chat = isinstance(req, ChatCompletionRequest)
        self.bodies = req.to_native()
        self.choices = [Choice() for _ in self.bodies]
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"

    # ---- pieces ------------------------------------------------------------------
    def echo_prefix(self, index: int) -> str:
        req = self.req
        if self.chat or not req.echo:
            return ""
        prompt = req.prompts()[index // req.n]
        return prompt if isinstance(prompt, str) else get_tokenizer(self.config).decode(prompt)

    def logprobs_of(self, entries: list[dict], offset: int) -> dict | None:
        """OpenAI logprobs for engine entries {token_id, logprob, top: [[id, logprob], ...]}."""
        want = self.req.logprobs
        if want is None or want is False:
            return None
        tok = get_tokenizer(self.config)

        def text(i: int) -> str:
            return tok.decode([i], skip_special_tokens=False)

        if self.chat:
            content = []
            for e in entries:
                top = [
                    {"token": text(i), "logprob": lp, "bytes": list(tok.decode_token_bytes(i))}
                    for i, lp in e.get("top", [])[: self.req.top_logprobs or 0]
                ]
                t = e["token_id"]
                content.append(
                    {
                        "token": text(t),
                        "logprob": e["logprob"],
                        "bytes": list(tok.decode_token_bytes(t)),
                        "top_logprobs": top,
                    }
                )
            return {"content": content, "refusal": None}
        tokens, offsets = [], []
        for e in entries:
            offsets.append(offset)
            tokens.append(text(e["token_id"]))
            offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{text(i): lp for i, lp in e.get("top", [])[:want]} for e in entries],
            "text_offset": offsets,
        }

    def usage(self) -> dict:
        # The prompt counts once per prompt, not once per choice (as OpenAI counts).
        n = self.req.n
        prompt = sum((c.usage or {}).get("prompt_tokens", 0) for k, c in enumerate(self.choices) if k % n == 0)
        completion = sum((c.usage or {}).get("completion_tokens", len(c.token_ids)) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def absorb(self, index: int, item: dict) -> tuple[str, dict | None]:
        """Fold an engine item into its choice; returns (text delta, logprobs of the delta)."""
        c = self.choices[index]
        prefix = ""
        if not c.started:
            c.started = True
            prefix = self.echo_prefix(index)
            c.prefix_len = len(prefix)
            c.text = prefix
        offset = len(c.text)
        token = item.get("token") or ""
        c.text += token
        c.token_ids += item.get("token_ids") or []
        entries = item.get("logprobs") or []
        c.logprobs += entries
        if item.get("is_end"):
            c.finish_reason = item.get("finish_reason") or "stop"
            c.usage = item.get("usage")
        return prefix + token, (self.logprobs_of(entries, offset) if entries else None)

    # ---- responses ------------------------------------------------------------------
    def chunk(self, index: int, delta: str, logprobs: dict | None, finish: str | None, first: bool) -> dict:
        if self.chat:
            d = {"role": "assistant", "content": delta} if first else {"content": delta}
            choice = {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model, "choices": [choice]}

    def final(self) -> dict:
        choices = []
        for k, c in enumerate(self.choices):
            lp = self.logprobs_of(c.logprobs, c.prefix_len) if c.logprobs else None
            if self.chat:
                msg = {"role": "assistant", "content": c.text}
                choices.append({"index": k, "message": msg, "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                choices.append({"index": k, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
            "usage": self.usage(),
        }


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n".encode()


async def handle_completions(request: Request, body: dict, backend: Backend, config: Config) -> Response:
    return await _handle(request, _parse(parse_completion, body), backend, config)


async def handle_chat(request: Request, body: dict, backend: Backend, config: Config) -> Response:
    return await _handle(request, _parse(parse_chat, body), backend, config)


def _parse(parse, body: dict):
    try:
        return parse(body)
    except OpenAIValidationError as e:
        raise ApiError(400, e.message, e.param) from None


async def _handle(request: Request, req, backend: Backend, config: Config) -> Response:
    call = _Call(req, config)
    merged = fanout(backend, call.bodies)
    try:
        first = await anext(merged)
    except BaseException:
        await merged.aclose()
        raise
    if first[1].get("error_code"):
        await merged.aclose()
        item = first[1]
        status = status_of(item["error_code"])
        return JSONResponse(openai_error(status, item.get("error_msg", "")), status_code=status)
    if req.stream:
        return StreamingResponse(_stream(call, first, merged), media_type=SSE, headers={"Cache-Control": "no-cache"})
    out = await until_disconnected(request, _collect(call, first, merged))
    if out is None:
        return Response(status_code=499)
    if "error" in out:
        return JSONResponse(out, status_code=out.pop("_status"))
    return JSONResponse(out)


async def _collect(call: _Call, first: tuple[int, dict], merged: AsyncIterator[tuple[int, dict]]) -> dict:
    async with contextlib.aclosing(merged):
        got = first
        while True:
            index, item = got
            if item.get("error_code"):
                status = status_of(item["error_code"])
                return {**openai_error(status, item.get("error_msg", "")), "_status": status}
            call.absorb(index, item)
            try:
                got = await anext(merged)
            except StopAsyncIteration:
                break
    return call.final()


async def _stream(
    call: _Call, first: tuple[int, dict], merged: AsyncIterator[tuple[int, dict]]
) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(merged):
        got: tuple[int, dict] | None = first
        while got is not None:
            index, item = got
            if item.get("error_code"):
                # Mid-stream failure: an error event, then the end of the stream.
                yield _sse(openai_error(status_of(item["error_code"]), item.get("error_msg", "")))
                break
            first_of_choice = not call.choices[index].started
            delta, lp = call.absorb(index, item)
            finish = call.choices[index].finish_reason
            chunk = call.chunk(index, delta, lp, finish, first_of_choice)
            if call.req.include_usage():
                chunk["usage"] = None
            yield _sse(chunk)
            got = await anext(merged, None)
        else:
            if call.req.include_usage():
                yield _sse({**call.chunk(0, "", None, None, False), "choices": [], "usage": call.usage()})
    yield _sse("[DONE]")
