"""OpenAI protocol over HTTP: /v1/completions and /v1/chat/completions.

Each choice is one native request to Triton (see protocol/openai.py); the
engine's items become OpenAI objects here. Streaming is SSE: one chunk per
engine item (the last one carries `finish_reason`), an optional usage chunk
(`stream_options.include_usage`), then `data: [DONE]`.

No tokenizer here: the engine spells logprob tokens (with their text offsets)
and sends the text of echoed token-id prompts (serving/responses.py).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from llmserve.config import Config
from llmserve.http.disconnect import until_disconnected
from llmserve.http.errors import ApiError, openai_error, status_of
from llmserve.http.fanout import first_of
from llmserve.http.streaming import StreamResponse
from llmserve.http.triton_client import Backend
from llmserve.protocol import native, tool_calls
from llmserve.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIValidationError,
    openai_param,
    parse_chat,
    parse_completion,
)
from llmserve.protocol.reasoning import ReasoningParser
from llmserve.protocol.tool_calls import ToolCallParser

SSE = "text/event-stream"
CONTEXT_ERROR = "maximum context length"


@dataclass
class Choice:
    """What one choice has produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)  # engine entries (serving/responses.py)
    finish_reason: str | None = None
    usage: dict | None = None
    started: bool = False
    prefix_len: int = 0  # echoed prompt characters at the start of `text`
    prompt_logprobs: list[dict] = field(default_factory=list)  # echo + logprobs
    # Chat with tools or REASONING_PARSER: the streamed text split into reasoning, content and calls.
    reasoning: ReasoningParser | None = None
    tools: ToolCallParser | None = None
    num_calls: int = 0  # tool calls streamed so far
    prompt_tokens: int = 0  # from the first item (continuous usage)


class _Call:
    """One OpenAI request in flight: its native bodies, choices and response framing."""

    def __init__(self, parsed: tuple[CompletionRequest | ChatCompletionRequest, list[dict]], config: Config) -> None:
        req, self.bodies = parsed  # the request and its native requests' records (`_parse`)
        self.req = req
        self.config = config
        self.chat = isinstance(req, ChatCompletionRequest)
        tools = self.chat and req.calls_tools
        reasoning = config.reasoning_parser if self.chat else ""
        self.choices = [
            Choice(
                reasoning=ReasoningParser(reasoning) if reasoning else None,
                tools=ToolCallParser(config.tool_call_parser) if tools else None,
            )
            for _ in self.bodies
        ]
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"
        # chat: logprobs true/false; completions: None or k >= 0 (0 is falsy but asks for them)
        self.want_logprobs = req.logprobs is not None and req.logprobs is not False

    # ---- pieces ------------------------------------------------------------------
    def error(self, item: dict) -> tuple[int, dict]:
        """(status, OpenAI error body) for an engine error item, naming the field the client sent."""
        status = status_of(item["error_code"])
        msg, native_param = item.get("error_msg", ""), item.get("error_param")
        param = openai_param(self.req, native_param)
        if param and native_param and param != native_param:
            msg = re.sub(rf"\b{re.escape(native_param)}\b", param, msg, count=1)
        code = None
        if CONTEXT_ERROR in msg:  # vLLM's answer, which clients map to a context-window error
            status, code = 400, "context_length_exceeded"
        elif status == 404 and param == "model":
            code = "model_not_found"
        return status, openai_error(status, msg, param, code)

    def echo_prefix(self, index: int, item: dict) -> str:
        req = self.req
        if self.chat or not req.echo:
            return ""
        # The engine's text of the prompt when it sent one (token-id prompts; with logprobs, whose
        # offsets count in it), else the prompt as sent.
        prompt = req.prompts()[index // req.n]
        return item.get("prompt_text", prompt if isinstance(prompt, str) else "")

    def logprobs_of(self, entries: list[dict], base: int, prompt: bool = False) -> dict | None:
        """OpenAI logprobs of engine entries; `base`: where the entries' text starts in the choice's text."""
        if self.chat:
            k = self.req.top_logprobs or 0
            content = [
                {
                    "token": e["token"],
                    "logprob": e["logprob"],
                    "bytes": e["bytes"],
                    "top_logprobs": [
                        {"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]} for t in e["top"][:k]
                    ],
                }
                for e in entries
            ]
            return {"content": content, "refusal": None}
        k = self.req.logprobs
        tops = []
        for e in entries:
            if e["top"] is None:  # the prompt's first token: nothing before it to predict it
                tops.append(None)
                continue
            top = {t["token"]: t["logprob"] for t in e["top"][:k]}
            top.setdefault(e["token"], e["logprob"])  # the chosen token is always there (logprobs=0: only it)
            tops.append(top)
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": tops,
            "text_offset": [base + e["text_offset"] for e in entries],
        }

    def usage(self) -> dict:
        # The prompt counts once per prompt, not once per choice (as OpenAI counts); mid-stream
        # (continuous_usage_stats) it is the first item's count.
        n = self.req.n
        firsts = [c.usage or {"prompt_tokens": c.prompt_tokens} for k, c in enumerate(self.choices) if k % n == 0]
        prompt = sum(u.get("prompt_tokens", 0) for u in firsts)
        cached = sum(u.get("cached_tokens", 0) for u in firsts)
        completion = sum((c.usage or {}).get("completion_tokens", len(c.token_ids)) for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def absorb(self, index: int, item: dict) -> tuple[str, dict | None]:
        """Fold an engine item into its choice; returns (text delta, logprobs of the delta)."""
        c = self.choices[index]
        prefix, prompt_entries = "", []
        if not c.started:
            c.started = True
            prefix = self.echo_prefix(index, item)
            c.prefix_len = len(prefix)
            c.text = prefix
            if prefix:
                prompt_entries = c.prompt_logprobs = item.get("prompt_logprobs") or []
        if "prompt_tokens" in item:
            c.prompt_tokens = item["prompt_tokens"]
        token = item.get("token") or ""
        c.text += token
        c.token_ids += item.get("token_ids") or []
        entries = item.get("logprobs") or []
        c.logprobs += entries
        if item.get("is_end"):
            c.finish_reason = item.get("finish_reason") or "stop"
            c.usage = item.get("usage")
        if not self.want_logprobs or not (entries or prompt_entries):
            return prefix + token, None
        lp = self.logprobs_of(entries, c.prefix_len)
        if prompt_entries:
            head = self.logprobs_of(prompt_entries, 0)
            lp = {k: head[k] + lp[k] for k in lp}
        return prefix + token, lp

    def split(self, index: int, delta: str, end: bool) -> dict:
        """A chat delta's fields: reasoning_content, content and tool_calls (REASONING_PARSER, tools);
        just content when neither is on."""
        c = self.choices[index]
        if c.reasoning is None and c.tools is None:
            return {"content": delta}
        reasoning, content = c.reasoning.feed(delta) if c.reasoning else ("", delta)
        if end and c.reasoning:
            r, t = c.reasoning.finish()
            reasoning, content = reasoning + r, content + t
        calls = []
        if c.tools:
            content, calls = c.tools.feed(content)
            if end:
                tail, more = c.tools.finish()
                content, calls = content + tail, calls + more
        out: dict = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if content:  # nothing while a call (or what may start one) is held back
            out["content"] = content
        if calls:
            out["tool_calls"] = tool_calls.stream_deltas(calls, c.num_calls)
            c.num_calls += len(calls)
        return out

    def finish_reason(self, index: int) -> str | None:
        """The engine's, or "tool_calls" when the model called a tool (and was not cut short)."""
        c = self.choices[index]
        calls = c.num_calls or (c.tools is not None and c.tools.calls)
        return "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason

    # ---- responses ------------------------------------------------------------------
    def chunk(self, index: int, delta: str, logprobs: dict | None, finish: str | None, first: bool) -> dict:
        if self.chat:
            return self._frame(index, {"role": "assistant", "content": delta} if first else {"content": delta})
        choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish}
        return self._frame(index, None, choice)

    def _frame(self, index: int, delta: dict | None, choice: dict | None = None, **fields) -> dict:
        if choice is None:
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None, **fields}
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model, "choices": [choice]}

    def chunks(self, index: int, delta: str, logprobs: dict | None, finish: str | None, first: bool) -> list[dict]:
        """The chunks of an engine item (completions: one). Chat as OpenAI streams it: with tools or a
        reasoning parser, a held-back call sends nothing until it is complete, then its id, type and name
        in one delta and its arguments in the next, and `finish_reason` comes in a chunk of its own."""
        if not self.chat:
            return [self.chunk(index, delta, logprobs, finish, first)]
        c = self.choices[index]
        parsed = c.reasoning is not None or c.tools is not None
        d = self.split(index, delta, finish is not None)
        calls = d.pop("tool_calls", [])
        deltas = [d] if d or not parsed else []
        deltas += [{"tool_calls": [t]} for t in calls]
        if first or (logprobs and not deltas):
            deltas = deltas or [{}]
            deltas[0] = {"role": "assistant", **deltas[0]} if first else deltas[0]
        out = [self._frame(index, x) for x in deltas]
        if logprobs:
            out[0]["choices"][0]["logprobs"] = logprobs
        if finish is not None:
            reason = self.finish_reason(index)
            if out and not parsed:  # plain content: the last piece ends the choice (as before)
                out[-1]["choices"][0]["finish_reason"] = reason
            else:
                out.append(self._frame(index, {}, finish_reason=reason))
        return out

    def final(self) -> dict:
        choices = []
        for k, c in enumerate(self.choices):
            lp = None
            if self.want_logprobs:
                lp = self.logprobs_of(c.logprobs, c.prefix_len)
                if c.prompt_logprobs:
                    head = self.logprobs_of(c.prompt_logprobs, 0)
                    lp = {key: head[key] + lp[key] for key in lp}
            if self.chat:
                msg = self.message(k)
                choices.append({"index": k, "message": msg, "logprobs": lp, "finish_reason": self.finish_reason(k)})
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

    def message(self, index: int) -> dict:
        """The assistant message of a whole chat choice: content, and reasoning_content / tool_calls
        where REASONING_PARSER / tools are on."""
        c = self.choices[index]
        msg: dict = {"role": "assistant", "content": c.text}
        text = c.text
        if c.reasoning is not None:
            reasoning, text = ReasoningParser.split(self.config.reasoning_parser, text)
            msg["reasoning_content"], msg["content"] = reasoning, text
        if c.tools is not None:
            content, calls = c.tools.parse(text)
            msg["content"] = content or None if calls else content
            msg["tool_calls"] = [t.openai() for t in calls]
        return msg


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n".encode()


async def handle_completions(request: Request, body: dict, backend: Backend, config: Config) -> Response:
    return await _handle(request, _parse(parse_completion, body, config), backend, config)


async def handle_chat(request: Request, body: dict, backend: Backend, config: Config) -> Response:
    return await _handle(request, _parse(parse_chat, body, config), backend, config)


def _parse(parse, body: dict, config: Config) -> tuple[CompletionRequest | ChatCompletionRequest, list[dict]]:
    """The request and the records of its native requests: each checked once, by the shared rules
    (protocol/native.py), an error named as the client sent the field."""
    try:
        req = parse(body)
    except OpenAIValidationError as e:
        raise ApiError(400, e.message, e.param) from None
    bodies = req.to_native()
    if isinstance(req, ChatCompletionRequest) and req.forces_tool_call:  # required / a named function: a grammar
        # A named function: one call of it (as vLLM); required: one, or more unless parallel_tool_calls is false.
        parallel = req.tool_choice == "required" and req.parallel_tool_calls is not False
        g = tool_calls.grammar(config.tool_call_parser, req.offered_tools(), parallel)
        bodies = [b | {"guided_grammar": g} for b in bodies]
    try:
        return req, [native.record(native.parse(b)) for b in bodies]
    except native.NativeError as e:
        param = openai_param(req, e.param)
        msg = e.msg.replace(e.param, param, 1) if e.param and param else e.msg
        raise ApiError(e.code, msg, param) from None


async def _handle(request: Request, parsed: tuple, backend: Backend, config: Config) -> Response:
    call = _Call(parsed, config)
    req = call.req
    first, merged = await first_of(backend, call.bodies)
    if first[1].get("error_code"):
        status, body = call.error(first[1])
        return JSONResponse(body, status_code=status)
    if req.stream:
        return StreamResponse(_stream(call, first, merged), media_type=SSE, headers={"Cache-Control": "no-cache"})
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
                status, body = call.error(item)
                return {**body, "_status": status}
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
                yield _sse(call.error(item)[1])
                break
            first_of_choice = not call.choices[index].started
            delta, lp = call.absorb(index, item)
            finish = call.choices[index].finish_reason
            for chunk in call.chunks(index, delta, lp, finish, first_of_choice):
                if call.req.include_usage():  # vLLM's continuous_usage_stats: the usage so far in each
                    chunk["usage"] = call.usage() if call.req.continuous_usage() else None
                yield _sse(chunk)
            got = await anext(merged, None)
        else:
            if call.req.include_usage():
                yield _sse({**call.chunk(0, "", None, None, False), "choices": [], "usage": call.usage()})
    yield _sse("[DONE]")
