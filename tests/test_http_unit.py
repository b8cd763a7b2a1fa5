"""The HTTP front end in-process, with a scripted backend in place of Triton.

Covers what does not need the engine: validation of both protocols, protocol
dispatch, response framing (NDJSON, SSE, usage, n, echo, logprobs), error
shapes and statuses, auth, body limits, the OpenAPI schema, and that closing a
stream closes the backend stream. test_http_stack.py runs the real stack.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from starlette.testclient import TestClient

from llmserve.config import Config
from llmserve.http.app import create_app

# Engine errors the scripted backend answers when the prompt holds the key: (code, message, native field).
SCRIPTED_ERRORS = {
    "CTX": (
        413,
        "This model's maximum context length is 64 tokens. However, your request has 80 input tokens.",
        "text",
    ),
    "MAXDEC": (400, "max_dec_len: 5000 exceeds MAX_DEC_LEN=1024", "max_dec_len"),
    "VOCAB": (400, "input_ids: token id 99999 is out of vocabulary (the vocabulary is [0, 512))", "input_ids"),
    "MODEL": (404, "The model `nope` does not exist; this server serves `default`.", "model"),
}


def entry(token_id: int, offset: int, top: list | None, logprob: float | None = -0.5) -> dict:
    """An engine logprob entry (serving/responses.py): token i is spelled <i>."""
    spell = f"<{token_id}>"
    tops = None if top is None else [{"token_id": t, "token": f"<{t}>", "bytes": [], "logprob": lp} for t, lp in top]
    return {
        "token_id": token_id,
        "token": spell,
        "bytes": list(spell.encode()),
        "logprob": logprob,
        "text_offset": offset,
        "top": tops,
    }


class ScriptedBackend:
    """Answers like the engine: `n_tokens` items of token `t<k>` (id 100 + k), or an error named in the prompt."""

    def __init__(self, n_tokens: int = 4, delay: float = 0.0) -> None:
        self.n_tokens = n_tokens
        self.delay = delay
        self.bodies: list[dict] = []
        self.closed: list[str] = []

    async def ready(self) -> bool:
        return True

    async def close(self) -> None:
        pass

    async def stream(self, body: dict):
        self.bodies.append(body)
        req_id = body["req_id"]
        prompt = body.get("text") or json.dumps(body.get("messages") or body.get("input_ids"))
        if "ERR" in prompt:
            code = int(prompt.split("ERR")[1][:3])
            yield {"req_id": req_id, "is_end": 1, "error_code": code, "error_msg": f"engine said {code}"}
            return
        for key, (code, msg, param) in SCRIPTED_ERRORS.items():
            if key in prompt:
                yield {"req_id": req_id, "is_end": 1, "error_code": code, "error_msg": msg, "error_param": param}
                return
        n = min(self.n_tokens, body.get("max_dec_len") or self.n_tokens)
        ids = body.get("input_ids") or [1, 2]
        try:
            for k in range(n):
                if self.delay:
                    await asyncio.sleep(self.delay)
                last = k == n - 1
                item = {"req_id": req_id, "token": f"t{k}", "token_ids": [100 + k], "is_end": int(last)}
                item |= {"send_idx": k, "error_code": 0, "error_msg": ""}
                if k == 0 and body.get("echo"):
                    item["prompt_text"] = "".join(f"<{i}>" for i in ids)
                if k == 0 and body.get("prompt_logprobs") is not None:
                    item["prompt_text"] = "".join(f"<{i}>" for i in ids)
                    offsets = [sum(len(f"<{j}>") for j in ids[:m]) for m in range(len(ids))]
                    item["prompt_logprobs"] = [
                        entry(t, o, None, None) if m == 0 else entry(t, o, [[t, -0.5], [7, -1.5]])
                        for m, (t, o) in enumerate(zip(ids, offsets))
                    ]
                if body.get("logprobs") is not None:
                    top = [[100 + k, -0.5], [7, -1.5], [8, -2.5]][: body["logprobs"]]
                    item["logprobs"] = [entry(100 + k, 2 * k, top)]
                if last:
                    item["tokens_all"] = "".join(f"t{j}" for j in range(n))
                    item["finish_reason"] = "length" if n == body.get("max_dec_len") else "stop"
                    if body.get("return_usage"):
                        item["usage"] = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
                yield item
        finally:
            self.closed.append(req_id)


@pytest.fixture
def backend():
    return ScriptedBackend()


@pytest.fixture
def client(backend):
    app = create_app(Config(), backend_factory=lambda cfg: backend, max_body_bytes=10_000)
    with TestClient(app) as c:
        yield c


URL = "/v1/chat/completions"


def sse(resp) -> list:
    events = [line[len("data: ") :] for line in resp.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ---- native ----------------------------------------------------------------------------
def test_native_stream_ndjson(client, backend):
    r = client.post(URL, json={"text": "hi", "req_id": "abc", "max_dec_len": 3, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert [x["token"] for x in lines] == ["t0", "t1", "t2"]
    assert [x["is_end"] for x in lines] == [0, 0, 1] and lines[-1]["tokens_all"] == "t0t1t2"
    assert backend.bodies[0]["req_id"] == "abc" and backend.bodies[0]["max_dec_len"] == 3


@pytest.mark.parametrize(
    "sent",
    [
        b'{"text": "hi", "req_id": "abc"}',
        '{"text":"h\\u00e9 \u00e9 \\ud83d\\ude00","max_dec_len":2}'.encode(),  # escapes, UTF-8
        b'{"input_ids":[1,2,3], "req_id": "x-1", "max_tokens": 4, "stop": "x"}',  # aliases, a lone stop
    ],
)
def test_native_sends_the_checked_record(client, backend, sent):
    """What goes on to Triton is the request as validated here: every field by its own name, aliases
    resolved and defaults filled in (the adapter and the engine take it as checked)."""
    from llmserve.protocol import native

    r = client.post(URL, content=sent, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    body = backend.bodies[-1]
    want = native.parse(json.loads(sent) | {"req_id": body["req_id"]})
    assert body == native.record(want) and body["req_id"]
    assert native.from_record(body) == want  # the engine server's copy, without validation


def test_native_non_stream_and_defaults(client, backend):
    r = client.post(URL, json={"text": "hi", "return_usage": True})
    body = r.json()
    assert r.status_code == 200 and body["error_code"] == 0 and body["error_msg"] == ""
    assert body["result"] == body["tokens_all"] == "t0t1t2t3" and body["token_ids"] == [100, 101, 102, 103]
    assert body["usage"]["completion_tokens"] == 4 and body["req_id"] == backend.bodies[0]["req_id"]
    assert len(body["req_id"]) > 8  # a random id was filled in


def test_native_without_model_is_native(client, backend):
    # `messages` alone (no model): native, answered as one JSON object.
    r = client.post(URL, json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and "tokens_all" in r.json()
    # A native-only field wins over `model`.
    r = client.post(URL, json={"model": "x", "messages": [{"role": "user", "content": "hi"}], "topp": 0.5})
    assert "tokens_all" in r.json()


@pytest.mark.parametrize(
    "body, field",
    [
        ({"text": "hi", "temperature": -1}, "temperature"),
        ({"text": "hi", "topp": -0.1}, "topp"),
        ({"text": "hi", "history": []}, "history"),
        ({"text": "hi", "seed": 1 << 63}, "seed"),
        ({"text": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
        ({"text": "hi", "logit_bias": {"3": 101}}, "logit_bias"),
        ({"text": "hi", "stop": [""]}, "stop"),
        ({"text": "hi", "top_p": 1.5}, "top"),
        ({"text": "hi", "max_dec_len": -3}, "max_dec_len"),
        ({"text": "hi", "min_dec_len": -1}, "min_dec_len"),
        ({"text": "hi", "max_dec_len": "many"}, "max_dec_len"),
        ({"text": ""}, "text"),
        ({"text": 5}, "text"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": ["a"]}, "input_ids"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages"),
        ({"text": "a", "input_ids": [1]}, "text"),
        ({"req_id": "x"}, "text"),
        ({"text": "hi", "timeout": 0}, "timeout"),
    ],
)
def test_native_validation(client, backend, body, field):
    r = client.post(URL, json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["error_code"] == 400 and field in err["error_msg"]
    assert not backend.bodies  # never reached Triton


@pytest.mark.parametrize("code", [409, 413, 429, 408, 503])
def test_native_engine_errors_keep_status(client, code):
    for stream in (False, True):
        r = client.post(URL, json={"text": f"ERR{code}", "stream": stream})
        assert r.status_code == code and r.json()["error_code"] == code


# ---- OpenAI ----------------------------------------------------------------------------
def test_openai_chat_non_stream(client, backend):
    msgs = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    r = client.post(URL, json={"model": "m", "messages": msgs, "max_completion_tokens": 3, "max_tokens": 9})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion" and body["model"] == "m"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "t0t1t2"}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    sent = backend.bodies[0]
    assert sent["max_dec_len"] == 3 and sent["messages"][0] == {"role": "system", "content": "be brief"}
    assert sent["messages"][1]["content"] == "hi" and sent["return_usage"] is True


def test_openai_sampling_fields_map_to_native(client, backend):
    seed = random.randrange(1000)
    body = {"model": "m", "prompt": "x", "temperature": 0, "top_p": 0.25, "presence_penalty": 1.5}
    body |= {"frequency_penalty": -0.5, "seed": seed, "stop": "END", "n": 2}
    assert client.post("/v1/completions", json=body).status_code == 200
    a, b = backend.bodies
    assert a["temperature"] == 0 and a["topp"] == 0.25 and a["presence_score"] == 1.5
    assert a["frequency_score"] == -0.5 and a["stop_sequences"] == ["END"] and a["max_dec_len"] == 16
    assert (a["seed"], b["seed"]) == (seed, seed + 1) and a["req_id"] != b["req_id"]


def test_openai_chat_stream_n_and_usage(client):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2}
    body |= {"max_tokens": 3, "stream_options": {"include_usage": True}}
    r = client.post(URL, json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = sse(r)
    *content, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["prompt_tokens"] == 3  # once per prompt, not per choice
    for i in (0, 1):
        mine = [c["choices"][0] for c in content if c["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"]["content"] for c in mine) == "t0t1t2"
        assert [c["finish_reason"] for c in mine] == [None, None, "length"]
    assert all(c["usage"] is None and c["object"] == "chat.completion.chunk" for c in content)


def test_openai_completions_prompts_echo_logprobs(client, backend):
    body = {"model": "m", "prompt": ["ab", "cd"], "echo": True, "logprobs": 1, "max_tokens": 2}
    r = client.post("/v1/chat/completions/completions", json=body)  # the seeds' base_url
    choices = r.json()["choices"]
    # With logprobs the echoed text is the engine's decoding of the prompt, where its offsets count.
    assert [c["text"] for c in choices] == ["<1><2>t0t1", "<1><2>t0t1"]
    lp = choices[0]["logprobs"]
    # The prompt's tokens first (the first has no logprob), then the output's; offsets index the text.
    assert lp["tokens"] == ["<1>", "<2>", "<100>", "<101>"]
    assert lp["token_logprobs"] == [None, -0.5, -0.5, -0.5]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][2] == {"<100>": -0.5}
    assert lp["text_offset"] == [0, 3, 6, 8]
    assert [(b["logprobs"], b["prompt_logprobs"]) for b in backend.bodies] == [(1, 1), (1, 1)]
    r = client.post("/v1/completions", json={"model": "m", "prompt": "ab", "echo": True, "max_tokens": 1})
    assert r.json()["choices"][0]["text"] == "abt0"  # without logprobs: the prompt as sent
    # logprobs=0: the chosen token alone.
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x", "logprobs": 0, "max_tokens": 2})
    assert r.json()["choices"][0]["logprobs"]["top_logprobs"] == [{"<100>": -0.5}, {"<101>": -0.5}]
    # Token-id prompts: the engine sends their text back.
    r = client.post("/v1/completions", json={"model": "m", "prompt": [5, 6], "echo": True, "max_tokens": 1})
    assert r.json()["choices"][0]["text"] == "<5><6>t0" and backend.bodies[-1]["echo"] is True


def test_openai_chat_logprobs_stream(client, backend):
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}], "logprobs": True, "top_logprobs": 2}
    chunks = sse(client.post("/v1/chat/completions/chat/completions", json=body | {"stream": True, "max_tokens": 2}))
    content = chunks[0]["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == "<100>" and content[0]["bytes"] == list(b"<100>") and content[0]["logprob"] == -0.5
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["<100>", "<7>"]
    assert backend.bodies[0]["logprobs"] == 2


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"model": "m", "prompt": ""}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": []}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": "3"}, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"model": "m", "prompt": "x", "top_p": 1.01}, "top_p"),
        ("/v1/completions", {"model": "m", "prompt": "x", "temperature": -0.1}, "temperature"),
        ("/v1/completions", {"model": "m", "prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ("/v1/completions", {"model": "m", "prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"model": "m", "prompt": "x", "logprobs": 9}, "logprobs"),
        ("/v1/completions", {"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "x"}, "model"),
        (URL, {"model": "m", "messages": []}, "messages"),
        (
            URL,
            {"model": "m", "messages": [{"role": "", "content": "x"}]},
            "messages.0.role",
        ),  # any other role goes to the chat template
        (URL, {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, None),
        (URL, {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_openai_validation(client, backend, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param:
        assert err["param"] == param and param in err["message"]
    assert not backend.bodies


def test_openai_engine_error_status(client):
    r = client.post("/v1/completions", json={"model": "m", "prompt": "ERR429"})
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    r = client.post("/v1/completions", json={"model": "m", "prompt": "ERR413", "stream": True})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


# ---- transport-level -------------------------------------------------------------------
@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b"\xff\xfe"])
def test_bad_bodies(client, raw):
    r = client.post(URL, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error_code"] == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_body_size_limit(client, backend):
    r = client.post(URL, json={"text": "x" * 20_000})
    assert r.status_code == 413 and "exceeds" in r.json()["error_msg"] and not backend.bodies


def test_unknown_route_is_json(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_models_and_openapi(client):
    assert client.get("/v1/models").json()["data"][0]["object"] == "model"
    assert client.get("/v1/chat/completions/models").status_code == 200
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    assert {"NativeRequest", "CompletionRequest", "ChatCompletionRequest"} <= set(schemas)
    assert "max_dec_len" in schemas["NativeRequest"]["properties"]
    assert "/v1/completions" in spec["paths"] and "/v1/chat/completions" in spec["paths"]


def test_api_key(backend):
    app = create_app(Config(api_key="s3cret"), backend_factory=lambda cfg: backend)
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200 and c.get("/v2/health/live").status_code == 200
        for method, path in [
            ("get", "/v1/models"),
            ("post", URL),
            ("post", "/v1/completions"),
            ("get", "/openapi.json"),
        ]:
            r = getattr(c, method)(path)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        bad = {"Authorization": "Bearer nope"}
        assert c.post(URL, json={"text": "hi"}, headers=bad).status_code == 401
        good = {"Authorization": "Bearer s3cret"}
        assert c.post(URL, json={"text": "hi"}, headers=good).status_code == 200
        assert c.get("/v1/models", headers=good).status_code == 200


def test_stream_close_closes_backend_streams():
    """Leaving a stream early closes every backend stream of the request (-> gRPC cancel)."""
    from llmserve.http.fanout import fanout

    backend = ScriptedBackend(n_tokens=1000, delay=0.001)

    async def run():
        merged = fanout(backend, [{"req_id": "a", "text": "x"}, {"req_id": "b", "text": "y"}])
        for _ in range(5):
            await anext(merged)
        await merged.aclose()

    asyncio.run(run())
    assert sorted(backend.closed) == ["a", "b"]


# ---- OpenAI conformance (issue 12) -----------------------------------------------------------
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "path, extra, param, words",
    [
        ("/v1/completions", {"frobnicate": 1}, "frobnicate", "Unrecognized request argument supplied"),
        (URL, {"response_format": "json"}, "response_format", "dictionary"),
        (URL, {"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools.0.function.name", "pattern"),
        (URL, {"tool_choice": "auto"}, "tool_choice", "needs tools"),
        ("/v1/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "chat"),
        (URL, {"functions": [{"name": "f"}]}, "functions", "deprecated"),
        (URL, {"stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ("/v1/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ("/v1/completions", {"seed": 1 << 63}, "seed", "seed"),
        ("/v1/completions", {"seed": -(1 << 63) - 1}, "seed", "seed"),
        ("/v1/completions", {"best_of": 3}, "best_of", "best_of"),
        ("/v1/completions", {"logit_bias": {"5": 100.5}}, "logit_bias", "[-100, 100]"),
        ("/v1/completions", {"logit_bias": {"five": 1}}, "logit_bias", "token ids"),
        (URL, {"messages": [{"role": "user", "content": "x", "audio": {}}]}, "audio", "not supported"),
    ],
)
def test_openai_fields_are_honoured_or_refused_by_name(client, backend, path, extra, param, words):
    body = (CHAT if path == URL else {"model": "m", "prompt": "x"}) | extra
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert not backend.bodies


def test_openai_accepted_fields_reach_the_engine(client, backend):
    body = {"model": "m", "prompt": "x", "n": 2, "seed": -1, "logit_bias": {"5": -100, "7": 2.5}, "ignore_eos": True}
    body |= {"user": "u1", "stop": ["a", "b", "c", "d"]}
    assert client.post("/v1/completions", json=body).status_code == 200
    a, b = backend.bodies
    assert (a["seed"], b["seed"]) == (-1, 0)  # choice i: seed + i, within int64
    assert a["logit_bias"] == {"5": -100, "7": 2.5} and a["ignore_eos"] is True and a["model"] == "m"
    top = {"model": "m", "prompt": "x", "n": 2, "seed": (1 << 63) - 1}
    assert client.post("/v1/completions", json=top).status_code == 200
    assert [x["seed"] for x in backend.bodies[2:]] == [(1 << 63) - 1, -(1 << 63)]
    ok = CHAT | {"response_format": {"type": "text"}, "tool_choice": "none", "stream": True}
    assert client.post(URL, json=ok | {"stream_options": {"include_usage": True}}).status_code == 200


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None])
@pytest.mark.parametrize("path", [URL, "/v1/completions"])
def test_non_json_bodies_are_415(client, backend, path, ctype):
    headers = {"content-type": ctype} if ctype else {}
    body = json.dumps({"model": "m", "prompt": "x"} if path != URL else {"text": "x"}).encode()
    r = client.post(path, content=body, headers=headers)
    assert r.status_code == 415, r.text
    assert "Content-Type" in r.json()["error"]["message"] and not backend.bodies


def test_json_media_types_with_parameters_or_suffix_are_accepted(client):
    for ctype in ("application/json; charset=utf-8", "application/merge-patch+json", "Application/JSON"):
        r = client.post(URL, content=json.dumps({"text": "x"}).encode(), headers={"content-type": ctype})
        assert r.status_code == 200, (ctype, r.text)


@pytest.mark.parametrize("stream", [False, True])
def test_engine_errors_name_the_openai_field(client, stream):
    def err(path, body):
        r = client.post(path, json=body | {"stream": stream})
        return r.status_code, r.json()["error"]

    status, e = err("/v1/completions", {"model": "m", "prompt": "CTX"})
    assert status == 400 and e["code"] == "context_length_exceeded" and e["param"] == "prompt"
    assert e["message"].startswith("This model's maximum context length is 64 tokens")
    status, e = err("/v1/completions", {"model": "m", "prompt": "MAXDEC", "max_tokens": 5000})
    assert status == 400 and e["param"] == "max_tokens" and e["message"].startswith("max_tokens: 5000 exceeds")
    chat = {"model": "m", "messages": [{"role": "user", "content": "MAXDEC"}], "max_completion_tokens": 5000}
    status, e = err(URL, chat)
    assert status == 400 and e["param"] == "max_completion_tokens" and "max_dec_len" not in e["message"]
    status, e = err("/v1/completions", {"model": "m", "prompt": "VOCAB"})
    assert status == 400 and e["param"] == "prompt" and e["message"].startswith("prompt: token id 99999")
    status, e = err("/v1/completions", {"model": "m", "prompt": "MODEL"})
    assert status == 404 and e["code"] == "model_not_found" and e["param"] == "model"


def test_native_keeps_its_codes_and_fields(client):
    r = client.post(URL, json={"text": "CTX"})
    assert r.status_code == 413 and r.json()["error_code"] == 413 and "maximum context length" in r.json()["error_msg"]
    r = client.post(URL, json={"text": "MAXDEC", "max_dec_len": 5000})
    assert r.status_code == 400 and r.json()["error_msg"].startswith("max_dec_len")
