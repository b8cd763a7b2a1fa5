"""Tool calls: parsing (whole and streamed, any cut), the grammars that force calls, and the protocol."""

from __future__ import annotations

import json
import random

import llguidance
import pytest

from llmserve.protocol.openai import OpenAIValidationError, parse_chat
from llmserve.protocol.tool_calls import ToolCallParser, grammar
from tests.test_http_unit import ScriptedBackend

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}

HERMES = [
    ("plain text", "plain text", []),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        "",
        [("get_weather", '{"city": "Oslo"}')],
    ),
    (
        'Let me look.\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}\n</tool_call>',
        "Let me look.\n",
        [("now", "{}"), ("get_weather", '{"city": "Rome", "unit": "c"}')],
    ),
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),  # kept as content
    ('open <tool_call>{"name": "now"', 'open <tool_call>{"name": "now"', []),  # never closed
    ("a < b <tool_", "a < b <tool_", []),  # what looked like a tag, at the end
]
LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", '{"city": "Oslo"}')]),
    ('<|python_tag|>{"name": "now", "parameters": {}}; {"name": "now", "parameters": {}}', "", [("now", "{}")] * 2),
    ("It is sunny.", "It is sunny.", []),
    ('{"not": "a call"}', '{"not": "a call"}', []),
]


def _stream(kind: str, text: str, rng: random.Random) -> tuple[str, list]:
    p, content, calls = ToolCallParser(kind), "", []
    i = 0
    while i < len(text):
        n = rng.randint(0, 7)
        c, got = p.feed(text[i : i + n])
        content, calls, i = content + c, calls + got, i + n
    c, got = p.finish()
    return content + c, calls + got


@pytest.mark.parametrize("kind,cases", [("hermes", HERMES), ("llama3_json", LLAMA3)])
def test_parsed_whole_and_streamed_at_any_cut(kind, cases, fresh_seed):
    rng = random.Random(fresh_seed)
    for text, content, calls in cases:
        whole = ToolCallParser(kind).parse(text)
        for got_content, got_calls in (whole, *(_stream(kind, text, rng) for _ in range(20))):
            assert got_content == content, (text, got_content)
            assert [(c.name, json.loads(c.arguments)) for c in got_calls] == [(n, json.loads(a)) for n, a in calls]


@pytest.mark.parametrize("kind", ["hermes", "llama3_json"])
@pytest.mark.parametrize("parallel", [False, True])
def test_forcing_grammars_accept_calls_and_nothing_else(kind, parallel):
    g = grammar(kind, [WEATHER, CLOCK], parallel)
    assert llguidance.LLMatcher.validate_grammar(g) == ""
    key = "arguments" if kind == "hermes" else "parameters"

    def call(name, args):
        body = json.dumps({"name": name, key: args}, separators=(",", ":"))
        return f"<tool_call>\n{body}\n</tool_call>" if kind == "hermes" else body

    sep = "\n" if kind == "hermes" else "; "
    one = call("get_weather", {"city": "Oslo"})
    two = one + sep + call("now", {})
    bad = [call("get_weather", {"unit": "c"}), call("get_time", {}), "Sure! " + one, call("now", {"x": 1})[:-1]]
    matches = _regex_free_check(g)
    assert matches(one)
    assert matches(two) == parallel
    for text in bad:
        assert not matches(text), text


def _regex_free_check(g: str):
    """Whether a whole text is a sentence of grammar g (byte-level llguidance matcher over a byte vocabulary)."""
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))

    def matches(text: str) -> bool:
        m = llguidance.LLMatcher(tok, g)
        for b in text.encode():
            if not m.consume_token(b):
                return False
        return m.is_accepting()

    return matches


class _Bytes:
    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([i]) for i in range(256)] + [b""]

    def __call__(self, s):
        return list(s.encode() if isinstance(s, str) else s)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "weather in Oslo?"}]}


def test_protocol_checks_tools():
    ok = parse_chat(
        CHAT | {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    assert ok.forces_tool_call and [t["function"]["name"] for t in ok.offered_tools()] == ["get_weather"]
    body = ok.to_native()[0]
    assert body["tools"][0]["function"]["name"] == "get_weather"
    assert "tools" not in parse_chat(CHAT | {"tools": [WEATHER], "tool_choice": "none"}).to_native()[0]
    bad = [
        ({"tool_choice": "required"}, "tool_choice: needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "no tool named 'x'"),
        ({"tools": [WEATHER, WEATHER]}, "same name"),
        ({"tools": [WEATHER], "parallel_tool_calls": False}, "parallel_tool_calls"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined",
        ),
        ({"functions": [{"name": "f"}]}, "deprecated"),
    ]
    for extra, words in bad:
        with pytest.raises(OpenAIValidationError, match=words):
            parse_chat(CHAT | extra)
    history = CHAT["messages"] + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
    ]  # fmt: skip
    msgs = parse_chat({"model": "m", "messages": history, "tools": [WEATHER]}).to_native()[0]["messages"]
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # an object, for the template
    assert msgs[2] == {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}


# ---- through the HTTP layer, with an engine that says a given text ---------------------------------
class TextBackend(ScriptedBackend):
    """Streams `text` in pieces of random sizes (the way detokenized tokens arrive), then stops."""

    def __init__(self, text: str, seed: int) -> None:
        super().__init__()
        self.text, self.rng = text, random.Random(seed)

    async def stream(self, body: dict):
        self.bodies.append(body)
        pieces, i = [], 0
        while i < len(self.text):
            n = self.rng.randint(1, 6)
            pieces.append(self.text[i : i + n])
            i += n
        for k, p in enumerate(pieces):
            last = k == len(pieces) - 1
            item = {"req_id": body["req_id"], "token": p, "token_ids": [k], "is_end": int(last), "send_idx": k}
            item |= {"error_code": 0, "error_msg": ""}
            if last:
                item |= {"finish_reason": "stop", "usage": {"prompt_tokens": 3, "completion_tokens": k + 1}}
            yield item


def _post(text: str, body: dict, seed: int, **settings):
    from fastapi.testclient import TestClient

    from llmserve.config import Config
    from llmserve.http.app import create_app

    backend = TextBackend(text, seed)
    app = create_app(Config(**settings), backend_factory=lambda cfg: backend)
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r, backend


def _events(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


SAID = 'Let me check.<think>not a tag now</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_reasoning_content_and_tool_calls_in_chat_responses(fresh_seed):
    text = "<think>\nThe user wants weather.</think>\n\n" + SAID
    body = CHAT | {"tools": [WEATHER]}
    r, backend = _post(text, body, fresh_seed, reasoning_parser="deepseek_r1")
    assert backend.bodies[0]["tools"][0]["function"]["name"] == "get_weather"  # rendered by the template
    msg = r.json()["choices"][0]
    assert msg["finish_reason"] == "tool_calls"
    m = msg["message"]
    assert m["reasoning_content"] == "The user wants weather."
    assert m["content"] == "Let me check.<think>not a tag now</think>\n"  # later tags are plain content
    (call,) = m["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'} and call["type"] == "function"

    r, _ = _post(text, body | {"stream": True}, fresh_seed + 1, reasoning_parser="deepseek_r1")
    deltas = [e["choices"][0]["delta"] for e in _events(r)]
    finish = [e["choices"][0]["finish_reason"] for e in _events(r)]
    assert finish[-1] == "tool_calls" and not any(finish[:-1])
    assert "".join(d.get("reasoning_content", "") for d in deltas) == m["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == m["content"]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"] and calls[0]["index"] == 0
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Oslo"}


def test_without_tools_or_parser_the_text_is_content(fresh_seed):
    r, backend = _post(SAID, CHAT, fresh_seed)
    m = r.json()["choices"][0]
    assert m["message"] == {"role": "assistant", "content": SAID} and m["finish_reason"] == "stop"
    assert backend.bodies[0]["tools"] is None


def test_the_demo_template_renders_tools_in_hermes_form(demo_dir):
    """The trained demo's chat template: tools listed in <tools>, earlier calls as <tool_call> blocks (what
    the hermes parser reads back), tool results as `tool` turns; without tools, plain ChatML as before."""
    from llmserve.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(demo_dir)
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "12 C", "tool_call_id": "c1"},
    ]
    text = tok.apply_chat_template(msgs, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nbe brief\n\n") and json.dumps(WEATHER) in text
    assert text.count("<|im_start|>system") == 1 and "<|im_start|>tool\n12 C<|im_end|>" in text
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    _, parsed = ToolCallParser("hermes").parse(turn)
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [("get_weather", {"city": "Oslo"})]
    plain = tok.apply_chat_template(msgs[:2])
    assert (
        plain == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n"
    )
