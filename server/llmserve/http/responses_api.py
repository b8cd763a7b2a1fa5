"""OpenAI's Responses API over HTTP: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request is served by the chat path (http/openai.py's call: the same native request, tool-call and
reasoning parsers); here its answer becomes a Response object, or, streamed, the Responses event
sequence (SSE with `event:` lines, no [DONE]):
  response.created, response.in_progress,
  per output item: response.output_item.added, then for a message response.content_part.added,
    response.output_text.delta..., response.output_text.done, response.content_part.done; for a
    function call response.function_call_arguments.delta, .done; then response.output_item.done,
  response.completed (response.incomplete when max_output_tokens cut it; response.failed on an error).
Responses are kept per worker for previous_response_id (http/responses_store.py).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from llmserve.config import Config
from llmserve.http.disconnect import until_disconnected
from llmserve.http.errors import ApiError
from llmserve.http.fanout import first_of
from llmserve.http.openai import _Call, _collect, _parse
from llmserve.http.responses_store import MAX_RESPONSES, TTL_S, ResponseStore
from llmserve.http.streaming import StreamResponse
from llmserve.http.triton_client import Backend
from llmserve.protocol.openai import OpenAIValidationError, parse_chat
from llmserve.protocol.responses_api import ResponsesRequest, parse_responses, responses_param


def _hex() -> str:
    return uuid.uuid4().hex


def _renamed(message: str, chat_param: str | None) -> tuple[str, str | None]:
    """An error of the chat path, naming the Responses field the client sent."""
    param = responses_param(chat_param)
    if chat_param and param and param != chat_param:
        message = message.replace(chat_param, param, 1)
    return message, param


def _text_part(text: str, logprobs: list | None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message(item_id: str, text: str, logprobs: list | None, status: str) -> dict:
    content = [_text_part(text, logprobs)] if status != "in_progress" else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _reasoning(item_id: str, text: str, done: bool) -> dict:
    content = [{"type": "reasoning_text", "text": text}] if done else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": "completed"}


def _function_call(call: dict, arguments: str, status: str) -> dict:
    return {
        "id": "fc_" + call["id"].removeprefix("call_"),
        "type": "function_call",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": arguments,
        "status": status,
    }


class _Reply:
    """One Responses request: the chat call serving it, and the Response object it makes."""

    def __init__(self, req: ResponsesRequest, chat_body: dict, call: _Call) -> None:
        self.req, self.call = req, call
        self.id = "resp_" + _hex()
        self.created_at = int(time.time())
        # The conversation to keep: what was sent, without the instructions (not carried over).
        self.history = chat_body["messages"][1:] if req.instructions is not None else chat_body["messages"]

    def usage(self) -> dict:
        u = self.call.usage()
        return {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"],
        }

    def response(self, status: str, output: list[dict], error: dict | None = None) -> dict:
        done = status in ("completed", "incomplete", "failed")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if done else None,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "output": output,
            "usage": self.usage() if done and error is None else None,
            **self.req.echo(),
        }

    def status(self) -> str:
        return "incomplete" if self.call.choices[0].finish_reason == "length" else "completed"

    def output_of(self, message: dict, logprobs: dict | None) -> list[dict]:
        """Output items of a whole chat message: reasoning, text, function calls."""
        out = []
        if message.get("reasoning_content"):
            out.append(_reasoning("rs_" + _hex(), message["reasoning_content"], True))
        calls = message.get("tool_calls") or []
        if message.get("content") or not (calls or out):  # an empty message only when nothing else came
            entries = (logprobs or {}).get("content")
            out.append(_message("msg_" + _hex(), message.get("content") or "", entries, "completed"))
        out += [_function_call(c, c["function"]["arguments"], "completed") for c in calls]
        return out

    def keep(self, store: ResponseStore, response: dict) -> None:
        """Keep the conversation with this response's output as the assistant's turn (its reasoning
        left out, as chat templates leave out earlier turns' reasoning)."""
        if not self.req.store:
            return
        out = response["output"]
        text = "".join(p["text"] for item in out if item["type"] == "message" for p in item["content"])
        calls = [
            {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
            for i in out
            if i["type"] == "function_call"
        ]
        assistant: dict = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            assistant["tool_calls"] = calls
        store.put(self.id, [*self.history, assistant], response)


def _prepare(body: dict, store: ResponseStore, config: Config) -> tuple[ResponsesRequest, dict, _Call]:
    try:
        req = parse_responses(body)
    except OpenAIValidationError as e:
        raise ApiError(400, e.message, e.param) from None
    history: list[dict] = []
    if req.previous_response_id is not None:
        kept = store.get(req.previous_response_id)
        if kept is None:
            raise ApiError(
                400,
                f"previous_response_id: no response {req.previous_response_id!r} is kept by this HTTP worker "
                f"(responses are kept {TTL_S / 60:.0f} min, at most {MAX_RESPONSES}, in the memory of the "
                "worker that made them, and not with store: false; with several HTTP workers another one may "
                "have it): send the conversation as input instead",
                "previous_response_id",
            )
        history = kept.messages
    chat_body = req.chat_body(history)
    try:
        parsed = _parse(parse_chat, chat_body, config)
    except ApiError as e:
        raise ApiError(e.status, *_renamed(e.message, e.param)) from None
    return req, chat_body, _Call(parsed, config)


def _error_json(call: _Call, item: dict) -> JSONResponse:
    status, body = call.error(item)
    err = body["error"]
    err["message"], err["param"] = _renamed(err["message"], err["param"])
    return JSONResponse(body, status_code=status)


async def handle_responses(
    request: Request, body: dict, backend: Backend, config: Config, store: ResponseStore
) -> Response:
    req, chat_body, call = _prepare(body, store, config)
    reply = _Reply(req, chat_body, call)
    first, merged = await first_of(backend, call.bodies)
    if first[1].get("error_code"):
        return _error_json(call, first[1])
    if req.stream:
        events = _events(reply, first, merged, store)
        return StreamResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    out = await until_disconnected(request, _collect(call, first, merged))
    if out is None:
        return Response(status_code=499)
    if "error" in out:
        err = out["error"]
        err["message"], err["param"] = _renamed(err["message"], err["param"])
        return JSONResponse({"error": err}, status_code=out["_status"])
    choice = out["choices"][0]
    response = reply.response(reply.status(), reply.output_of(choice["message"], choice["logprobs"]))
    reply.keep(store, response)
    return JSONResponse(response)


class _Events:
    """The SSE events of a streamed response, numbered, and the output items made so far."""

    def __init__(self, reply: _Reply) -> None:
        self.reply = reply
        self.seq = 0
        self.output: list[dict] = []  # finished items
        self.open: dict | None = None  # the message or reasoning item being written
        self.text = ""
        self.logprobs: list[dict] = []

    def event(self, kind: str, **fields) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()

    def lifecycle(self, kind: str, status: str, error: dict | None = None) -> bytes:
        return self.event(kind, response=self.reply.response(status, list(self.output), error))

    def where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def write(self, kind: str, delta: str, logprobs: list) -> list[bytes]:
        """A text delta of a message (`kind` "message") or of reasoning ("reasoning")."""
        out = []
        if self.open is not None and self.open["type"] != kind:
            out += self.close()
        if self.open is None:
            self.open = (
                _message("msg_" + _hex(), "", None, "in_progress")
                if kind == "message"
                else {**_reasoning("rs_" + _hex(), "", False), "status": "in_progress"}
            )
            part = _text_part("", None) if kind == "message" else {"type": "reasoning_text", "text": ""}
            out.append(self.event("response.output_item.added", output_index=len(self.output), item=self.open))
            out.append(self.event("response.content_part.added", **self.where(), content_index=0, part=part))
        self.text += delta
        self.logprobs += logprobs
        if not delta:
            pass
        elif kind == "message":
            out.append(self.event("response.output_text.delta", **self.where(), content_index=0, delta=delta,
                                  logprobs=logprobs))  # fmt: skip
        else:
            out.append(self.event("response.reasoning_text.delta", **self.where(), content_index=0, delta=delta))
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        item_id, where = self.open["id"], self.where()
        if self.open["type"] == "message":
            item = _message(item_id, self.text, self.logprobs, "completed")
            done = [self.event("response.output_text.done", **where, content_index=0, text=self.text,
                               logprobs=self.logprobs)]  # fmt: skip
        else:
            item = _reasoning(item_id, self.text, True)
            done = [self.event("response.reasoning_text.done", **where, content_index=0, text=self.text)]
        done.append(self.event("response.content_part.done", **where, content_index=0, part=item["content"][0]))
        done.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        self.output.append(item)
        self.open, self.text, self.logprobs = None, "", []
        return done

    def function_call(self, call: dict) -> list[bytes]:
        out = self.close()
        index, args = len(self.output), call["function"]["arguments"]
        added = _function_call(call, "", "in_progress")
        where = {"item_id": added["id"], "output_index": index}
        out.append(self.event("response.output_item.added", output_index=index, item=added))
        out.append(self.event("response.function_call_arguments.delta", **where, delta=args))
        out.append(self.event("response.function_call_arguments.done", **where, arguments=args))
        item = _function_call(call, args, "completed")
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return out


async def _events(
    reply: _Reply, first: tuple[int, dict], merged: AsyncIterator[tuple[int, dict]], store: ResponseStore
) -> AsyncIterator[bytes]:
    ev, call = _Events(reply), reply.call
    choice = call.choices[0]
    yield ev.lifecycle("response.created", "in_progress")
    yield ev.lifecycle("response.in_progress", "in_progress")
    async with contextlib.aclosing(merged):
        got: tuple[int, dict] | None = first
        sent_calls = 0
        while got is not None:
            item = got[1]
            if item.get("error_code"):  # mid-stream: the response fails, with what it had so far
                for chunk in ev.close():
                    yield chunk
                _, body = call.error(item)
                error = {"code": "server_error", "message": body["error"]["message"]}
                yield ev.lifecycle("response.failed", "failed", error)
                return
            delta, lp = call.absorb(0, item)
            d = call.split(0, delta, choice.finish_reason is not None)
            if d.get("reasoning_content"):
                for chunk in ev.write("reasoning", d["reasoning_content"], []):
                    yield chunk
            if d.get("content"):
                tokens = lp["content"] if lp and choice.tools is None and choice.reasoning is None else []
                for chunk in ev.write("message", d["content"], tokens):
                    yield chunk
            calls = [c.openai() for c in choice.tools.calls[sent_calls:]] if choice.tools else []
            sent_calls += len(calls)
            for c in calls:
                for chunk in ev.function_call(c):
                    yield chunk
            got = await anext(merged, None)
    if not ev.output and ev.open is None:  # nothing was said: an empty message, as the whole response has
        for chunk in ev.write("message", "", []):
            yield chunk
    for chunk in ev.close():
        yield chunk
    status = reply.status()
    final = reply.response(status, ev.output)
    reply.keep(store, final)
    yield ev.event("response.completed" if status == "completed" else "response.incomplete", response=final)
