"""Backends: send one benchmark request, stream the answer, time it.

Each backend's `send(req, rid)` returns a RequestResult and never raises: a
transport error, an HTTP error or an error inside the stream becomes a failure
with a code (the protocol's error_code, else the HTTP status, else the
exception's class name).

Fixed output lengths: the native protocol has no `ignore_eos`, so native and
triton-grpc send `min_dec_len = max_dec_len`; the engine backend sets
`ignore_eos` (and min_tokens); the OpenAI backends send `max_tokens` plus the
vLLM extensions `min_tokens` and `ignore_eos` and report the server's `usage`.
All backends decode greedily by default: `temperature: 0` (docs/api.md: 0 is greedy on
every protocol).

`counters()` snapshots the server's speculative decoding counters (see metrics.py):
served backends scrape `metrics_url` (the server's Prometheus endpoint), the engine
backend reads the engine's stats.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.request
from typing import Any

from llmserve.bench.metrics import RequestResult, prometheus_counters
from llmserve.bench.workload import BenchRequest, Vocab

BACKENDS = ("native", "openai-completions", "openai-chat", "triton-grpc", "engine")
# The server publishes its counters with the engine's heartbeat (every 0.5 s), after the tokens.
SETTLE_S = 3.0


def scrape_counters(url: str, timeout: float = 2.0) -> dict | None:
    """The speculative decoding counters at a Prometheus endpoint; None when unreachable or absent."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return prometheus_counters(r.read().decode("utf-8", "replace"))
    except (OSError, http.client.HTTPException, ValueError):
        return None


def _new_result(req: BenchRequest) -> RequestResult:
    return RequestResult(input_len=req.input_len, expected_input_len=req.input_len, expected_output_len=req.output_len)


class _Timer:
    """TTFT and ITL from the arrival times of token-carrying chunks."""

    def __init__(self, res: RequestResult) -> None:
        self.res = res
        self.last = res.start = time.perf_counter()
        self.first = True

    def chunk(self, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if self.first:
            self.res.ttft, self.first = now - self.res.start, False
        else:
            self.res.itl.append(now - self.last)
        self.last = now

    def done(self, end: float | None = None) -> RequestResult:
        self.res.latency = (time.perf_counter() if end is None else end) - self.res.start
        self.res.success = not self.res.error_code and not self.first
        if not self.res.error_code and self.first:
            self.res.fail("no_output", "the stream ended without a token")
        return self.res


class Backend:
    name = ""
    # Greedy in a native body: `temperature: 0` (what the engine process accepts).
    metrics_url = ""  # the server's Prometheus metrics: speculative decoding's counters (none: not read)

    def __init__(self, host: str, port: int, vocab: Vocab, temperature: float = 0.0, timeout: float = 300.0) -> None:
        self.host, self.port, self.vocab = host, port, vocab
        self.temperature, self.timeout = temperature, timeout

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def prepare(self, req: BenchRequest) -> None:
        """Work on a request that can be done before it is sent (outside the measured time)."""

    async def send(self, req: BenchRequest, rid: str) -> RequestResult:
        raise NotImplementedError

    async def counters(self, since: dict | None = None, tokens: int = 0) -> dict | None:
        """A snapshot of the server's cumulative counters (metrics.prometheus_counters), None when
        there are none. With `since` (the snapshot before some requests) it waits, up to SETTLE_S,
        until the server's count of generated tokens has grown by their `tokens`: until it has
        published what they did."""
        if not self.metrics_url:
            return None
        deadline = time.monotonic() + SETTLE_S
        while True:
            snap = await asyncio.to_thread(scrape_counters, self.metrics_url)
            if snap is None or since is None or time.monotonic() > deadline:
                return snap
            if snap["generation_tokens"] - since["generation_tokens"] >= tokens:
                return snap
            await asyncio.sleep(0.1)

    def native_body(self, req: BenchRequest, rid: str) -> dict[str, Any]:
        n = req.output_len
        body = {"req_id": rid, "input_ids": req.prompt_ids, "max_dec_len": n, "min_dec_len": n}
        body |= {"temperature": self.temperature} if self.temperature > 0 else {"temperature": 0.0}
        return body | {"stream": True, "return_usage": True}

    @staticmethod
    def on_native_item(item: dict, res: RequestResult, timer: _Timer) -> bool:
        """Account one native response object; True when the request is over."""
        if item.get("error_code"):
            res.fail(item["error_code"], str(item.get("error_msg", "")))
            return True
        ids = item.get("token_ids") or []
        if ids:
            timer.chunk()
            res.output_len += len(ids)
        if item.get("is_end"):
            usage = item.get("usage")
            if usage:
                res.input_len = int(usage.get("prompt_tokens", res.input_len))
            return True
        return False


class _HTTPBackend(Backend):
    path = ""

    async def start(self) -> None:
        import aiohttp

        # When each request's body has been written: the client's own delay in a burst.
        trace = aiohttp.TraceConfig()
        trace.on_request_chunk_sent.append(_on_chunk_sent)
        self.session = aiohttp.ClientSession(
            base_url=f"http://{self.host}:{self.port}",
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            trace_configs=[trace],
        )

    async def close(self) -> None:
        await self.session.close()

    async def send(self, req: BenchRequest, rid: str) -> RequestResult:
        res = _new_result(req)
        body = self.body(req, rid)
        timer = _Timer(res)
        try:
            async with self.session.post(self.path, json=body, trace_request_ctx=res) as resp:
                if resp.status != 200:
                    res.fail(*await _http_error(resp))
                else:
                    await self.read_stream(resp, res, timer)
        except asyncio.TimeoutError:
            res.fail("timeout", f"no answer within {self.timeout} s")
        except Exception as e:  # transport errors: connection refused, reset, bad payload
            res.fail(type(e).__name__, str(e))
        return timer.done()

    def body(self, req: BenchRequest, rid: str) -> dict[str, Any]:
        raise NotImplementedError

    async def read_stream(self, resp, res: RequestResult, timer: _Timer) -> None:
        raise NotImplementedError


async def _on_chunk_sent(session, ctx, params) -> None:
    res = ctx.trace_request_ctx
    if isinstance(res, RequestResult) and not res.sent:
        res.sent = time.perf_counter() - res.start


async def _http_error(resp) -> tuple[str, str]:
    text = await resp.text()
    try:
        obj = json.loads(text)
    except ValueError:
        return str(resp.status), text
    if isinstance(obj, dict) and obj.get("error_code"):  # native
        return str(obj["error_code"]), str(obj.get("error_msg", ""))
    err = obj.get("error") if isinstance(obj, dict) else None
    return str(resp.status), str(err.get("message", text) if isinstance(err, dict) else text)


class NativeBackend(_HTTPBackend):
    """POST /v1/chat/completions with `input_ids`; NDJSON stream."""

    name, path = "native", "/v1/chat/completions"

    def body(self, req: BenchRequest, rid: str) -> dict[str, Any]:
        return self.native_body(req, rid)

    async def read_stream(self, resp, res: RequestResult, timer: _Timer) -> None:
        async for line in resp.content:
            if line.strip() and self.on_native_item(json.loads(line), res, timer):
                return
        res.fail("truncated", "the stream ended without is_end")


class _OpenAIBackend(_HTTPBackend):
    """SSE streams; token counts from the final `usage` chunk."""

    chat = False

    async def start(self) -> None:
        await super().start()
        self.model = await self._model_name()
        overhead = self.vocab.chat_overhead if self.chat else self.vocab.text_overhead
        self.overhead = overhead or 0

    async def _model_name(self) -> str:
        try:
            async with self.session.get("/v1/models") as resp:
                data = (await resp.json())["data"]
                return data[0]["id"]
        except Exception:
            return "model"

    def prepare(self, req: BenchRequest) -> None:
        self.prompt_text(req)

    def prompt_text(self, req: BenchRequest) -> str:
        # Leave room for what the server adds (BOS, chat template) so its count is the one asked.
        if req.prompt is None:
            keep = max(1, req.input_len - self.overhead)
            req.prompt = self.vocab.text_for(req.prompt_ids[:keep])
        return req.prompt

    def body(self, req: BenchRequest, rid: str) -> dict[str, Any]:
        n = req.output_len
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": n,
            "min_tokens": n,
            "ignore_eos": True,
            "temperature": float(self.temperature),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        text = self.prompt_text(req)
        if self.chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        return body

    async def read_stream(self, resp, res: RequestResult, timer: _Timer) -> None:
        chunks = 0
        usage = None
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                err = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
                res.fail(err.get("code") or "stream_error", str(err.get("message", "")))
                return
            # Every chunk with choices counts, as vLLM's bench does: a token whose text is
            # still empty (a special token, half a UTF-8 character) is a token all the same.
            if obj.get("choices"):
                timer.chunk()
                chunks += 1
            if obj.get("usage"):
                usage = obj["usage"]
        else:
            res.fail("truncated", "the stream ended without data: [DONE]")
            return
        if usage:
            res.input_len = int(usage.get("prompt_tokens", res.input_len))
            res.output_len = int(usage.get("completion_tokens", chunks))
        else:
            res.output_len = chunks


class OpenAICompletionsBackend(_OpenAIBackend):
    name, path = "openai-completions", "/v1/completions"


class OpenAIChatBackend(_OpenAIBackend):
    name, path, chat = "openai-chat", "/v1/chat/completions", True


class TritonGRPCBackend(Backend):
    """Triton model `model` over a gRPC stream: IN/OUT hold native JSON."""

    name = "triton-grpc"
    model_name = "model"

    async def start(self) -> None:
        import tritonclient.grpc.aio as grpcclient

        self.client = grpcclient.InferenceServerClient(url=f"{self.host}:{self.port}")

    async def close(self) -> None:
        # With a grace period (tritonclient's close has none): a stream whose final response came may
        # still be open a moment, and cancelling it leaves Triton holding the model (docs/serving.md).
        await self.client._channel.close(grace=5.0)

    async def send(self, req: BenchRequest, rid: str) -> RequestResult:
        import numpy as np
        import tritonclient.grpc as grpcclient

        res = _new_result(req)
        inp = grpcclient.InferInput("IN", [1], "BYTES")
        inp.set_data_from_numpy(np.array([json.dumps(self.native_body(req, rid)).encode()], dtype=np.object_))
        timer = _Timer(res)

        async def requests():
            yield {"model_name": self.model_name, "inputs": [inp], "request_id": rid}

        stream = self.client.stream_infer(requests(), stream_timeout=self.timeout)
        ended = False  # the request's last response came: the stream ends by itself
        try:
            async for result, error in stream:
                if error is not None:
                    res.fail(error.status() or "grpc_error", error.message())
                    break
                out = result.as_numpy("OUT")
                if out is None:  # an empty final response
                    ended = True
                    break
                if self.on_native_item(json.loads(out.reshape(-1)[0]), res, timer):
                    ended = True
                    break
            else:
                ended = True
                if not res.error_code and timer.first:
                    res.fail("truncated", "the stream ended without is_end")
        except Exception as e:
            res.fail(type(e).__name__, str(e))
        finally:
            # Cancel only a stream that has not ended: Triton (2.x, as pytriton ships it) keeps the
            # model of a stream cancelled after its final response loaded, and a later stop then
            # waits for its exit timeout (docs/serving.md).
            if not ended:
                stream.cancel()
        return timer.done()


def make_backend(name: str, host: str, port: int, vocab: Vocab, **kw: Any) -> Backend:
    classes = {
        "native": NativeBackend,
        "openai-completions": OpenAICompletionsBackend,
        "openai-chat": OpenAIChatBackend,
        "triton-grpc": TritonGRPCBackend,
    }
    if name not in classes:
        raise ValueError(f"unknown backend {name!r}; one of {', '.join(BACKENDS)}")
    return classes[name](host, port, vocab, **kw)
