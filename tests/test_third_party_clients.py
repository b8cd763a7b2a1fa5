"""Clients people already use, against the real stack (start_server.sh on free loopback ports):
langchain-openai, the openai SDK's helpers (`chat.completions.parse` and `.stream`), and tritonclient
(HTTP on the health port, gRPC streaming to the decoupled model). Each is checked against what the
server answers to the plain openai client for the same greedy request, so a client that drops or
mangles a field fails here. litellm and guidellm are too heavy for CI (docs/clients.md): they run
from scripts/lab/check_clients.py.
"""

from __future__ import annotations

import json
import queue
import uuid

import pytest

from llmserve.serving.testing import http_stack

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

PROMPT = "def fib(n):"
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


class Weather(pydantic.BaseModel):
    """The weather in a city."""

    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(pattern="^[A-Za-z ]{1,12}$")  # a random model's strings: short, no escapes


class Answer(pydantic.BaseModel):
    n: int = pydantic.Field(ge=0, le=99)
    ok: bool


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = http_stack(tmp_path_factory.mktemp("clients"), PUSH_MODE_HTTP_WORKERS=1, API_KEY="", MAX_DEC_LEN=256)
    s.start()
    yield s
    assert s.stop().returncode == 0


@pytest.fixture(scope="module")
def client(stack):
    return openai.Client(base_url=stack.http_base + "/v1", api_key="x", max_retries=0)


def greedy(client, prompt: str, max_tokens: int) -> str:
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0
    )
    return r.choices[0].message.content


# ---- the openai SDK's helpers -------------------------------------------------------------
def test_openai_parse_gives_the_pydantic_object(client):
    r = client.chat.completions.parse(
        model="default", messages=[{"role": "user", "content": "x = "}], response_format=Answer, max_tokens=48,
        temperature=0,
    )  # fmt: skip
    msg = r.choices[0].message
    assert isinstance(msg.parsed, Answer) and msg.parsed == Answer.model_validate_json(msg.content), msg


def test_openai_stream_helper_text(client):
    """content.delta events add up to the final completion (a grammar ends it with "stop": the helper's
    final completion refuses one cut by max_tokens)."""
    messages = [{"role": "user", "content": PROMPT}]
    kw = {"model": "default", "messages": messages, "max_tokens": 32, "temperature": 0}
    kw["extra_body"] = {"guided_choice": ["return fib(n - 1) + fib(n - 2)", "pass"]}
    with client.chat.completions.stream(**kw) as s:
        events = list(s)
        final = s.get_final_completion()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "content.delta"]
    done = [e for e in events if e.type == "content.done"]
    whole = client.chat.completions.create(**kw).choices[0].message.content
    assert "".join(deltas) == final.choices[0].message.content == whole, kinds
    assert len(done) == 1 and done[0].content == whole and final.choices[0].finish_reason == "stop"


def test_openai_stream_helper_fires_arguments_done(client):
    """The helper's `tool_calls.function.arguments.done` carries the parsed arguments (a strict
    pydantic tool), and the final completion holds the same call."""
    tools = [openai.pydantic_function_tool(Weather, name="get_weather")]
    named = {"type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    with client.chat.completions.stream(
        model="default", messages=messages, tools=tools, tool_choice=named, max_tokens=96, temperature=0
    ) as s:
        events = list(s)
        final = s.get_final_completion()
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert len(done) == 1, [e.type for e in events]
    assert done[0].name == "get_weather" and isinstance(done[0].parsed_arguments, Weather)
    (call,) = final.choices[0].message.tool_calls
    assert call.function.parsed_arguments == done[0].parsed_arguments
    assert final.choices[0].finish_reason == "tool_calls"


# ---- langchain-openai -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(stack):
    lc = pytest.importorskip("langchain_openai")

    def make(max_tokens: int):
        base = stack.http_base + "/v1"
        return lc.ChatOpenAI(model="default", base_url=base, api_key="x", temperature=0, max_tokens=max_tokens,
                             max_retries=0)  # fmt: skip

    return make


def test_langchain_invoke_and_stream(chat_model, client):
    want = greedy(client, PROMPT, 16)
    chat_model = chat_model(16)
    msg = chat_model.invoke(PROMPT)
    assert msg.content == want
    assert msg.usage_metadata["output_tokens"] > 0 and msg.response_metadata["finish_reason"] in ("stop", "length")
    assert "".join(chunk.content for chunk in chat_model.stream(PROMPT)) == want


def test_langchain_structured_output_and_tools(chat_model):
    got = chat_model(64).with_structured_output(SCHEMA | {"title": "answer"}, method="json_schema")
    jsonschema.validate(got.invoke("x = "), SCHEMA)
    parsed = chat_model(64).with_structured_output(Answer, method="json_schema").invoke("x = ")
    assert isinstance(parsed, Answer)

    with_tools = chat_model(96).bind_tools([Weather], tool_choice="Weather")
    msg = with_tools.invoke("weather in Oslo?")
    (call,) = msg.tool_calls
    assert call["name"] == "Weather" and call["id"]
    Weather.model_validate(call["args"])


# ---- tritonclient -----------------------------------------------------------------------------
def test_tritonclient_http_on_the_health_port(stack):
    http = pytest.importorskip("tritonclient.http")
    c = http.InferenceServerClient(f"127.0.0.1:{stack.ports['HEALTH_HTTP_PORT']}")
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("model")
    meta = c.get_model_metadata("model")
    assert [i["name"] for i in meta["inputs"]] == ["IN"] and [o["name"] for o in meta["outputs"]] == ["OUT"]


def test_tritonclient_grpc_streams_the_native_protocol(stack, client):
    """Raw tritonclient.grpc (no llmserve helper): one JSON request in IN, one message per step in
    OUT on the decoupled stream; the greedy text is the OpenAI completion's."""
    grpc = pytest.importorskip("tritonclient.grpc")
    np = pytest.importorskip("numpy")
    got: queue.Queue = queue.Queue()
    c = grpc.InferenceServerClient(stack.grpc_url)
    c.start_stream(callback=lambda result, error: got.put(error or json.loads(result.as_numpy("OUT").reshape(-1)[0])))
    try:
        body = {"req_id": uuid.uuid4().hex, "text": PROMPT, "max_dec_len": 12, "temperature": 0.0}
        inp = grpc.InferInput("IN", [1], "BYTES")
        inp.set_data_from_numpy(np.array([json.dumps(body).encode()], dtype=np.object_))
        c.async_stream_infer("model", [inp], request_id=body["req_id"])
        msgs = []
        while not (msgs and msgs[-1].get("is_end")):
            msg = got.get(timeout=60)
            assert isinstance(msg, dict), msg
            msgs.append(msg)
    finally:
        c.stop_stream()
        c.close()
    assert all(m.get("error_code", 0) == 0 for m in msgs), msgs
    want = client.completions.create(model="default", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    assert "".join(m.get("token", "") for m in msgs) == want
