"""What third-party clients send and expect (issue 46, points 1-6), on the real stack (Triton, the engine
process, the HTTP front end on loopback) driven with the real openai / requests / tritonclient clients.

Logprobs under every kind of grammar are strict JSON on every protocol, streamed and not (masked tokens
are left out of top lists; the front end's own 5xx counted: test_http_failures.py); continuous usage;
the tool-call stream shape the openai SDK's helper follows; /v1/models/{model}; OpenAI's no-effect
fields and `prediction`; echo of token-id prompts, extra message fields and roles, vLLM's
out-of-vocabulary words.
"""

from __future__ import annotations

import json
import math
import queue
import uuid

import pytest
import requests

from llmserve.protocol import native, tool_calls
from llmserve.protocol.openai import parse_chat

openai = pytest.importorskip("openai")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
K = 5  # top logprobs asked (completions' most)


def strict_loads(text: str | bytes):
    """json.loads that refuses the non-JSON constants Python writes for -inf, inf and NaN."""

    def refuse(const: str):
        raise ValueError(f"not JSON: {const}")

    return json.loads(text, parse_constant=refuse)


# Each kind of grammar as each protocol asks for it (a forced tool call: chat's tool_choice; elsewhere
# the same grammar given as guided_grammar, which is what chat sends on).
TOOL_GRAMMAR = tool_calls.grammar("hermes", [WEATHER], False)
GRAMMARS = {
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
    "tool_call": {"guided_grammar": TOOL_GRAMMAR},
    "guided_choice": {"guided_choice": ["yes", "no", "maybe"]},
    "guided_regex": {"guided_regex": "[a-c]{3}-[0-9]{2}"},
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, demo_dir):
    from llmserve.serving.testing import http_stack

    s = http_stack(tmp_path_factory.mktemp("clients"), MAX_SEQ_LEN=2048, MAX_DEC_LEN=1024, PUSH_MODE_HTTP_WORKERS=1)
    s.start()
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.http_base + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    from llmserve.engine.tokenizer import load_tokenizer

    return load_tokenizer(demo_dir)


def _sse(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(strict_loads(line[6:]))
    return out


def _native_tops(items: list[dict]) -> list[list[float]]:
    return [[t["logprob"] for t in e["top"]] for it in items for e in it.get("logprobs") or []]


def _chat_tops(lps: list[dict | None]) -> list[list[float]]:
    return [[t["logprob"] for t in e["top_logprobs"]] for lp in lps if lp for e in lp["content"]]


def _completion_tops(lps: list[dict | None]) -> list[list[float]]:
    # The chosen token is always there beside the top k: the k best alone are the entries other than it.
    out = []
    for lp in lps:
        for tok, top in zip(lp["tokens"], lp["top_logprobs"]) if lp else ():
            out.append([v for t, v in top.items() if t != tok])
    return out


def _grpc_raw(url: str, body: dict, timeout: float = 120) -> list[bytes]:
    """Every OUT tensor of one request over Triton's gRPC stream, as the bytes tritonclient hands over."""
    import tritonclient.grpc as grpcclient

    from llmserve.serving.tritonserver import MODEL_NAME
    from llmserve.triton.client import _input

    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(url)
    c.start_stream(callback=lambda result, error: got.put(error or result.as_numpy("OUT").reshape(-1)[0]))
    try:
        c.async_stream_infer(MODEL_NAME, [_input(json.dumps(body).encode())], request_id=uuid.uuid4().hex)
        out = []
        while True:
            raw = got.get(timeout=timeout)
            assert isinstance(raw, bytes), raw
            out.append(raw)
            if strict_loads(raw).get("is_end"):
                return out
    finally:
        c.stop_stream()
        c.close()


def test_logprobs_under_every_grammar_are_strict_json_on_every_protocol(stack, fresh_seed):
    base = stack.http_base
    failures_before = stack.metrics().get('llmserve_request_failure_total{error_code="500"}', 0.0)
    prompt = "Answer in the asked form:"
    messages = [{"role": "user", "content": prompt}]
    tops: dict[str, list[list[float]]] = {}
    for kind, grammar in GRAMMARS.items():
        sampling = {"temperature": 0.8, "seed": fresh_seed}
        for stream in (False, True):
            where = f"{kind}, stream={stream}"
            # native over HTTP: NDJSON lines or one object
            body = {"messages": messages, "max_dec_len": 24, "logprobs": K, "stream": stream, **sampling, **grammar}
            r = requests.post(base + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, (where, r.text)
            items = [strict_loads(line) for line in r.text.splitlines()] if stream else [strict_loads(r.text)]
            assert all(not it["error_code"] for it in items), (where, items[-1])
            tops.setdefault("native", []).extend(_native_tops(items))

            # OpenAI chat: a forced tool call is tool_choice with tools
            extra = {"tools": [WEATHER], "tool_choice": NAMED} if kind == "tool_call" else grammar
            body = {"model": "default", "messages": messages, "max_tokens": 24, "logprobs": True, "top_logprobs": K}
            r = requests.post(
                base + "/v1/chat/completions", json=body | sampling | extra | {"stream": stream}, timeout=120
            )
            assert r.status_code == 200, (where, r.text)
            docs = _sse(r.text) if stream else [strict_loads(r.text)]
            tops.setdefault("chat", []).extend(_chat_tops([c["logprobs"] for d in docs for c in d["choices"]]))

            # OpenAI completions
            body = {"model": "default", "prompt": prompt, "max_tokens": 24, "logprobs": K, "stream": stream}
            r = requests.post(base + "/v1/completions", json=body | sampling | grammar, timeout=120)
            assert r.status_code == 200, (where, r.text)
            docs = _sse(r.text) if stream else [strict_loads(r.text)]
            tops.setdefault("completions", []).extend(
                _completion_tops([c["logprobs"] for d in docs for c in d["choices"]])
            )

        # Triton gRPC (decoupled: always a stream of OUT tensors)
        body = {"messages": messages, "max_dec_len": 24, "logprobs": K, **sampling, **grammar}
        items = [strict_loads(raw) for raw in _grpc_raw(stack.grpc_url, body)]
        assert all(not it["error_code"] for it in items), (kind, items[-1])
        tops.setdefault("grpc", []).extend(_native_tops(items))
    for proto, lists in tops.items():
        assert lists, proto
        assert all(math.isfinite(v) for top in lists for v in top), proto
        # The grammars mask most of the vocabulary: some steps had fewer than K candidates, left out, not -inf.
        assert any(len(top) < K for top in lists), proto
    assert stack.metrics().get('llmserve_request_failure_total{error_code="500"}', 0.0) == failures_before


def test_continuous_usage_stats_in_every_chunk(stack, client):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for create, kw in [
        (client.chat.completions.create, {"messages": [{"role": "user", "content": "Tell me a story"}]}),
        (client.completions.create, {"prompt": "Once upon a time"}),
    ]:
        chunks = list(create(model="default", max_tokens=12, stream=True, stream_options=opts, **kw))
        assert all(ch.usage is not None for ch in chunks), chunks
        final = chunks[-1]
        assert not final.choices and final.usage.completion_tokens == 12
        counts = [ch.usage.completion_tokens for ch in chunks]
        assert counts == sorted(counts) and counts[0] >= 1
        assert {ch.usage.prompt_tokens for ch in chunks} == {
            final.usage.prompt_tokens
        } and final.usage.prompt_tokens > 0
    # guidellm's request shapes (text and chat benchmarks: a fixed output length), as raw JSON
    fixed = {"stream": True, "stream_options": opts, "stop": None, "ignore_eos": True}
    for path, body in [
        ("/v1/completions", {"prompt": "benchmark " * 8, "max_tokens": 6}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}], "max_completion_tokens": 6}),
    ]:
        r = requests.post(stack.http_base + path, json={"model": "default"} | body | fixed, timeout=120)
        assert r.status_code == 200, (path, r.text)
        chunks = _sse(r.text)
        assert chunks[-1]["usage"]["completion_tokens"] == 6 and all(ch["usage"] for ch in chunks), path


def test_streamed_tool_calls_follow_openai_and_the_sdk_helper(stack, client):
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    kw = {
        "model": "default",
        "messages": messages,
        "tools": [WEATHER],
        "tool_choice": NAMED,
        "max_tokens": 200,
        "temperature": 0,
    }
    done = []
    with client.chat.completions.stream(**kw) as s:
        for ev in s:
            if ev.type == "tool_calls.function.arguments.done":
                done.append(ev)
        final = s.get_final_completion()
    assert len(done) == 1, done
    assert done[0].name == "get_weather" and isinstance(done[0].parsed_arguments, dict), done[0]
    assert isinstance(done[0].parsed_arguments["city"], str)
    (call,) = final.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == done[0].parsed_arguments
    assert final.choices[0].finish_reason == "tool_calls"

    # The chunks themselves: no empty content while the call is written; name, then arguments, then the end.
    r = requests.post(stack.http_base + "/v1/chat/completions", json=kw | {"stream": True}, timeout=120)
    chunks = [c["choices"][0] for c in _sse(r.text)]
    assert all(c["delta"].get("content") != "" for c in chunks), chunks
    with_calls = [c for c in chunks if c["delta"].get("tool_calls")]
    head, *args = with_calls
    (h,) = head["delta"]["tool_calls"]
    assert h["id"] and h["type"] == "function" and h["function"]["name"] == "get_weather" and h["index"] == 0
    assert args and all(
        c["delta"]["tool_calls"][0]["index"] == 0 and "name" not in c["delta"]["tool_calls"][0]["function"]
        for c in args
    )
    assert (
        json.loads("".join(c["delta"]["tool_calls"][0]["function"]["arguments"] for c in args))
        == done[0].parsed_arguments
    )
    assert [c["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}

    # Not streamed, and the SDK's parse() with a pydantic tool
    pydantic = pytest.importorskip("pydantic")

    class GetWeather(pydantic.BaseModel):
        city: str

    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    parsed = client.chat.completions.parse(**(kw | {"tools": [tool]}))
    (call,) = parsed.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_models_retrieve_for_every_accepted_name(stack, client):
    listed = [m.id for m in client.models.list()]
    for name in dict.fromkeys([*listed, "default"]):
        m = client.models.retrieve(name)
        assert m.id == name and m.object == "model"
        r = requests.get(f"{stack.http_base}/v1/chat/completions/models/{name}", timeout=10)  # the seeds' base_url
        assert r.status_code == 200 and r.json()["id"] == name
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["param"] == "model"


def test_openai_fields_clients_send_are_accepted_or_refused(stack, client):
    chat = {"model": "default", "messages": [{"role": "user", "content": "Say something"}], "max_tokens": 8}
    accepted = {"store": False, "metadata": {"run": "46"}, "service_tier": "auto", "reasoning_effort": "low"}
    accepted |= {"user": "u-1"}
    greedy = client.chat.completions.create(**chat, temperature=0).choices[0].message.content
    got = client.chat.completions.create(**chat, temperature=0, **accepted).choices[0].message.content
    assert got == greedy  # no effect
    # The legacy completions API has none of them in the SDK; clients send them as extra fields.
    assert client.completions.create(model="default", prompt="x", max_tokens=2, extra_body=accepted).choices
    # A prediction (of the greedy answer, as an edit would give it) never changes what is sampled.
    for content in (greedy, [{"type": "text", "text": greedy[:4]}, {"type": "text", "text": greedy[4:]}]):
        pred = {"type": "content", "content": content}
        assert (
            client.chat.completions.create(**chat, temperature=0, prediction=pred).choices[0].message.content == greedy
        )
    text = client.completions.create(model="default", prompt="x", max_tokens=4, temperature=0).choices[0].text
    same = client.completions.create(
        model="default",
        prompt="x",
        max_tokens=4,
        temperature=0,
        extra_body={"prediction": {"type": "content", "content": text}},
    )
    assert same.choices[0].text == text
    for extra, param in [
        ({"prediction": {"type": "text", "content": "x"}}, "prediction.type"),
        ({"prediction": {"type": "content", "content": 5}}, "prediction.content"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"metadata": {"k": 1}}, "metadata.k"),
        ({"parallel_tool_calls": True}, "parallel_tool_calls"),  # without tools, as OpenAI answers
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**chat, **extra)
        assert e.value.body["param"] == param, (extra, e.value.body)


def test_prediction_tokens_reach_the_sampling_params(tokenizer):
    text = "def add(a, b):\n    return a + b\n"
    req = parse_chat({
        "model": "m", "messages": [{"role": "user", "content": "rename"}],
        "prediction": {"type": "content", "content": [{"type": "text", "text": text[:5]}, {"type": "text", "text": text[5:]}]},
    })  # fmt: skip
    (body,) = req.to_native()
    assert body["prediction"] == text
    ((parsed, ids),) = native.tokenize_burst([native.parse(body)], tokenizer)
    params = native.admit(parsed, ids, 2048, 1024)
    assert params.prediction == text and params.prediction_token_ids == tokenizer.encode(text, False)
    assert type(params)(**params.as_dict()).prediction_token_ids == params.prediction_token_ids  # the core's copy
    ((parsed, ids),) = native.tokenize_burst([native.parse(body | {"prediction": text * 50})], tokenizer)
    with pytest.raises(native.NativeError) as e:
        native.admit(parsed, ids, len(ids) + 8, 4)  # a prediction longer than the context
    assert e.value.param == "prediction" and e.value.code == 400
    (plain,) = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]}).to_native()
    assert "prediction" not in plain


def test_echo_of_token_id_prompts_roles_extra_fields_and_vocabulary(stack, client, tokenizer):
    ids = [0, 0, *tokenizer.encode("hello world", False)]  # special tokens first: they are echoed too
    prompt_text = tokenizer.decode(ids, False)
    assert prompt_text.startswith("<") and prompt_text.endswith("hello world")
    c = client.completions.create(model="default", prompt=ids, echo=True, max_tokens=3)
    assert c.choices[0].text.startswith(prompt_text) and len(c.choices[0].text) > len(prompt_text)
    chunks = client.completions.create(model="default", prompt=ids, echo=True, max_tokens=3, stream=True)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices).startswith(prompt_text)
    c = client.completions.create(model="default", prompt=ids, echo=True, max_tokens=3, logprobs=2)
    lp = c.choices[0].logprobs
    assert lp.tokens[: len(ids)] == [tokenizer.decode([t], False) for t in ids] and lp.token_logprobs[0] is None
    assert lp.text_offset[: len(ids)] == sorted(lp.text_offset[: len(ids)]) and lp.text_offset[len(ids)] == len(
        prompt_text
    )

    # Extra message fields go to the chat template (the demo's ignores them); a role it does not know it refuses.
    (body,) = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x", "lang": "en"}]}).to_native()
    assert body["messages"][0] == {"role": "user", "content": "x", "lang": "en"}
    (body,) = parse_chat({"model": "m", "messages": [{"role": "narrator", "content": "x"}]}).to_native()
    assert body["messages"][0]["role"] == "narrator"
    msgs = [{"role": "user", "content": "hi", "lang": "en"}]
    assert client.chat.completions.create(model="default", messages=msgs, max_tokens=2).choices
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=[{"role": "narrator", "content": "x"}], max_tokens=2)
    assert e.value.body["param"] == "messages" and "narrator" in e.value.body["message"]

    # vLLM's words for an id past the vocabulary, which clients match
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt=[1, 10**7], max_tokens=2)
    assert "out of vocabulary" in e.value.body["message"] and e.value.body["param"] == "prompt"
