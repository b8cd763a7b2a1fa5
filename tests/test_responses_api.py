"""OpenAI's Responses API on the real stack (start_server.sh: Triton, the engine, one HTTP worker),
driven by the openai SDK's `client.responses.create`, `.stream`, `.parse`, `.retrieve` and `.delete`.

A response is served by the chat path, so greedy Responses text equals greedy chat text for the same
conversation: that is how `instructions`, message input, function-call items and
`previous_response_id` are shown to be honoured, not just accepted.
"""

from __future__ import annotations

import json

import pytest

from llmserve.serving.testing import http_stack

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

PROMPT = "def fib(n):"
CITY = {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"}  # a random model's strings: short, no escapes
PARAMS = {"type": "object", "properties": {"city": CITY}, "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "the weather in a city", "parameters": PARAMS}
EVENTS_OF_A_MESSAGE = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # One HTTP worker: previous_response_id needs the worker that made the response (docs/api.md).
    s = http_stack(tmp_path_factory.mktemp("responses"), PUSH_MODE_HTTP_WORKERS=1, API_KEY="", MAX_DEC_LEN=256)
    s.start()
    yield s
    assert s.stop().returncode == 0


@pytest.fixture(scope="module")
def client(stack):
    return openai.Client(base_url=stack.http_base + "/v1", api_key="x", max_retries=0)


def chat_text(client, messages: list[dict], max_tokens: int, **kw) -> str:
    r = client.chat.completions.create(model="default", messages=messages, max_tokens=max_tokens, temperature=0, **kw)
    return r.choices[0].message.content


def test_create_with_text_messages_and_instructions(client):
    r = client.responses.create(model="default", input=PROMPT, max_output_tokens=12, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output_text == chat_text(client, [{"role": "user", "content": PROMPT}], 12)
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    u = r.usage
    assert 0 < u.output_tokens <= 12 and u.input_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens
    assert (r.status == "incomplete") == (u.output_tokens == 12 and r.incomplete_details is not None)

    messages = [{"role": "user", "content": "x = 1"}, {"role": "assistant", "content": "y = 2"},
                {"role": "user", "content": [{"type": "input_text", "text": "print("}]}]  # fmt: skip
    r = client.responses.create(
        model="default", input=messages, instructions="You write Python.", max_output_tokens=10, temperature=0
    )
    flat = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else "print("}
            for m in messages]  # fmt: skip
    assert r.output_text == chat_text(client, [{"role": "system", "content": "You write Python."}, *flat], 10)
    assert r.instructions == "You write Python." and r.max_output_tokens == 10


def test_incomplete_when_max_output_tokens_cuts_it(client):
    r = client.responses.create(model="default", input=PROMPT, max_output_tokens=1, temperature=0)
    assert r.usage.output_tokens == 1
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_stream_has_the_responses_event_sequence(client):
    whole = client.responses.create(model="default", input=PROMPT, max_output_tokens=16, temperature=0)
    with client.responses.stream(model="default", input=PROMPT, max_output_tokens=16, temperature=0) as stream:
        events = list(stream)
        # The SDK's final response needs response.completed; one cut by max_output_tokens ends with
        # response.incomplete (as OpenAI streams it), which carries the response too.
        final = stream.get_final_response() if whole.status == "completed" else events[-1].response
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2, kinds
    # created, in_progress, the message's added events, its deltas, its done events, then the end
    squeezed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    end = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert squeezed == [*EVENTS_OF_A_MESSAGE, end], kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text == final.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.total_tokens == whole.usage.total_tokens

    raw = client.responses.create(model="default", input=PROMPT, max_output_tokens=16, temperature=0, stream=True)
    assert [e.type for e in raw][0] == "response.created"


def test_logprobs_streamed_and_whole(client):
    kw = {"model": "default", "input": PROMPT, "max_output_tokens": 8, "temperature": 0, "top_logprobs": 2}
    whole = client.responses.create(**kw, include=["message.output_text.logprobs"])
    lps = whole.output[0].content[0].logprobs
    assert len(lps) == whole.usage.output_tokens and all(len(t.top_logprobs) == 2 for t in lps)
    assert all(t.logprob <= 0 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in lps)
    assert all(t.top_logprobs[0].token == t.token for t in lps)  # greedy: the chosen token is the top one
    events = list(client.responses.create(**kw, stream=True))
    streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in lps]


def test_function_tools_and_call_outputs(client):
    tools = [TOOL, {"type": "function", "name": "now", "parameters": {"type": "object", "properties": {}}}]
    ask = [{"role": "user", "content": "weather in Oslo?"}]
    r = client.responses.create(
        model="default", input=ask, tools=tools, tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=96, temperature=0,
    )  # fmt: skip
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), PARAMS)
    assert r.status == "completed" and r.tools[0].name == "get_weather"

    with client.responses.stream(
        model="default", input=ask, tools=tools, tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=96, temperature=0,
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and isinstance(json.loads(done[0].arguments), dict), kinds
    assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.delta")
    assert kinds[-1] == "response.completed"
    (streamed_call,) = [o for o in final.output if o.type == "function_call"]
    assert streamed_call.arguments == done[0].arguments and streamed_call.id == done[0].item_id

    # The call and its output as input items: the same prompt as the chat conversation with them.
    items = [*ask, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "12 C, rain"}]  # fmt: skip
    r2 = client.responses.create(model="default", input=items, max_output_tokens=8, temperature=0)
    chat = [*ask, {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "12 C, rain"}]  # fmt: skip
    assert r2.output_text == chat_text(client, chat, 8)
    # ... and after previous_response_id, only the output goes in.
    out = [{"type": "function_call_output", "call_id": call.call_id, "output": "12 C, rain"}]
    r3 = client.responses.create(
        model="default", previous_response_id=r.id, input=out, max_output_tokens=8, temperature=0
    )
    assert r3.output_text == r2.output_text and r3.previous_response_id == r.id
    # ... and the SDK's way of keeping the context by hand: the output items sent back as they came.
    r4 = client.responses.create(model="default", input=[*ask, *r.output, *out], max_output_tokens=8, temperature=0)
    assert r4.output_text == r2.output_text


def test_previous_response_id_retrieve_and_delete(client):
    first = client.responses.create(model="default", input="x = 1", instructions="Be short.", max_output_tokens=8,
                                    temperature=0)  # fmt: skip
    then = client.responses.create(
        model="default", previous_response_id=first.id, input="y = ", max_output_tokens=8, temperature=0
    )
    # The kept conversation without the first instructions (OpenAI does not carry them over).
    conversation = [{"role": "user", "content": "x = 1"}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "y = "}]  # fmt: skip
    assert then.output_text == chat_text(client, conversation, 8)
    assert then.usage.input_tokens > first.usage.input_tokens

    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", previous_response_id=first.id, input="z", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id" and "kept" in e.value.body["message"]

    unkept = client.responses.create(model="default", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", previous_response_id=unkept.id, input="z", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


def test_parse_with_a_json_schema(client):
    pydantic = pytest.importorskip("pydantic")

    class Answer(pydantic.BaseModel):
        n: int
        ok: bool

    r = client.responses.parse(model="default", input="x = ", text_format=Answer, max_output_tokens=48,
                               temperature=0)  # fmt: skip
    assert isinstance(r.output_parsed, Answer), r.output_text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "x", "frobnicate": 1}, "frobnicate"),
        ({"input": [{"type": "web_search_call", "id": "w"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "name": "f"}]}, "input[1].call_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": ""}, "input"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "bogus"}}}},
            "text.format",
        ),  # fmt: skip
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
    ],
)
def test_bad_requests_name_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", extra_body=body)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body


def test_the_store_is_bounded_and_expires(monkeypatch):
    """No stack: the per-worker store drops the oldest past its count or size, and what outlived its TTL."""
    from llmserve.http import responses_store
    from llmserve.http.responses_store import ResponseStore

    now = [1000.0]
    monkeypatch.setattr(responses_store.time, "monotonic", lambda: now[0])
    store = ResponseStore(ttl_s=60, max_responses=3, max_chars=10_000)
    for k in range(4):
        store.put(f"r{k}", [{"role": "user", "content": str(k)}], {"id": f"r{k}"})
        now[0] += 10
    assert store.get("r0") is None and [store.get(f"r{k}").response["id"] for k in (1, 2, 3)] == ["r1", "r2", "r3"]
    store.put("big", [{"role": "user", "content": "x" * 9_950}], {"id": "big"})  # the others no longer fit
    assert len(store) == 1 and store.get("big") is not None
    store.put("huge", [{"role": "user", "content": "x" * 20_000}], {"id": "huge"})  # over the whole store
    assert store.get("huge") is None
    now[0] += 61
    assert store.get("big") is None and len(store) == 0
    store.put("a", [], {"id": "a"})
    assert store.delete("a") and not store.delete("a")


@pytest.fixture(scope="module")
def thinking_stack(tmp_path_factory):
    """Two HTTP workers and REASONING_PARSER=deepseek_r1 (the demo never closes </think>: all its
    output is reasoning)."""
    s = http_stack(tmp_path_factory.mktemp("responses2"), PUSH_MODE_HTTP_WORKERS=2, API_KEY="", MAX_DEC_LEN=64,
                   REASONING_PARSER="deepseek_r1")  # fmt: skip
    s.start()
    yield s
    assert s.stop().returncode == 0


def test_reasoning_items(thinking_stack):
    client = openai.Client(base_url=thinking_stack.http_base + "/v1", api_key="x", max_retries=0)
    kw = {"model": "default", "input": PROMPT, "max_output_tokens": 8, "temperature": 0}
    chat = (
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0
        )
        .choices[0]
        .message
    )
    whole = client.responses.create(**kw)
    assert [o.type for o in whole.output] == ["reasoning"] and not chat.content
    assert whole.output[0].content[0].text == chat.reasoning_content
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds and "response.output_text.delta" not in kinds, kinds
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == chat.reasoning_content and events[-1].response.output[0].content[0].text == text


def test_previous_response_id_with_two_workers(thinking_stack):
    """Each follow-up (on a new connection: the kernel spreads connections over the workers) is
    served when its worker made the first response, else refused naming previous_response_id."""
    outcomes = []
    for _ in range(8):
        first = openai.Client(base_url=thinking_stack.http_base + "/v1", api_key="x", max_retries=0).responses.create(
            model="default", input="x = 1", max_output_tokens=2, temperature=0
        )
        client = openai.Client(base_url=thinking_stack.http_base + "/v1", api_key="x", max_retries=0)
        try:
            then = client.responses.create(
                model="default", previous_response_id=first.id, input="y", max_output_tokens=2, temperature=0
            )
            assert then.previous_response_id == first.id and then.usage.input_tokens > first.usage.input_tokens
            outcomes.append("served")
        except openai.BadRequestError as e:
            assert e.body["param"] == "previous_response_id" and "several HTTP workers" in e.body["message"]
            outcomes.append("refused")
    print("follow-ups over two workers:", outcomes)
