"""protocol/reasoning.py: <think>…</think> splitting, whole and streamed (any cutting gives the same result)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.protocol.reasoning import REASONING_PARSERS, ReasoningParser

# (kind, output text, expected reasoning (None: did not reason), expected content)
CASES = [
    # deepseek_r1: starts inside the reasoning
    ("deepseek_r1", "", "", ""),
    ("deepseek_r1", "Let me think.\n</think>\n\nThe answer is 4.", "Let me think.\n", "The answer is 4."),
    ("deepseek_r1", "\nhmm</think>\nok", "hmm", "ok"),  # one "\n" at the start, one after the close
    ("deepseek_r1", "\n\nhmm</think>\n\n\nok", "\nhmm", "\nok"),  # only ONE "\n" / "\n\n" stripped
    ("deepseek_r1", "<think>\nhmm</think>ok", "hmm", "ok"),  # optional leading tag dropped
    ("deepseek_r1", "  \n<think>\n\nhmm</think>ok", "\nhmm", "ok"),  # whitespace before it dropped too
    ("deepseek_r1", "still thinking, never closed", "still thinking, never closed", ""),
    ("deepseek_r1", "<think>never closed\n", "never closed\n", ""),
    ("deepseek_r1", "</think>just content", "", "just content"),
    ("deepseek_r1", "a<think>b</think>c<think>d</think>e", "a<think>b", "c<think>d</think>e"),
    ("deepseek_r1", "r</think>\n\n<think>x</think>", "r", "<think>x</think>"),  # later tags are content
    ("deepseek_r1", "ends with a partial </thi", "ends with a partial </thi", ""),
    ("deepseek_r1", "<thin", "<thin", ""),
    ("deepseek_r1", "  ", "  ", ""),
    ("deepseek_r1", "\n", "", ""),
    ("deepseek_r1", "r</think>\n", "r", ""),
    ("deepseek_r1", "é</think>\né", "é", "é"),
    # qwen3: reasons only when the output opens with <think>
    ("qwen3", "", None, ""),
    ("qwen3", "<think>\nLet me think.\n</think>\n\nThe answer is 4.", "Let me think.\n", "The answer is 4."),
    ("qwen3", "<think>\n\n</think>\n\nHi!", "\n", "Hi!"),  # Qwen3's empty think block (thinking disabled)
    ("qwen3", "The answer is 4.", None, "The answer is 4."),
    ("qwen3", "  \n The answer", None, "  \n The answer"),  # no tag: whitespace is content
    ("qwen3", "\n <think>hmm</think>\nok", "hmm", "ok"),  # leading whitespace before the tag dropped
    ("qwen3", "<think>never closed", "never closed", ""),
    ("qwen3", "<think>", "", ""),
    ("qwen3", "answer <think>x</think> more", None, "answer <think>x</think> more"),
    ("qwen3", "<think>a</think>b<think>c</think>", "a", "b<think>c</think>"),
    ("qwen3", "<thin", None, "<thin"),  # a partial tag that never completed is text
    ("qwen3", "  <thi", None, "  <thi"),
    ("qwen3", "</think>x", None, "</think>x"),
    ("qwen3", "<think>r</thi", "r</thi", ""),
    ("qwen3", "<think>r</think>", "r", ""),
    ("qwen3", " ", None, " "),
]


def _stream(kind: str, deltas: list[str]) -> tuple[str, str]:
    parser = ReasoningParser(kind)
    reasoning, content = [], []
    for d in deltas:
        r, c = parser.feed(d)
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    return "".join(reasoning) + r, "".join(content) + c


@pytest.mark.parametrize("kind,text,reasoning,content", CASES)
def test_split(kind: str, text: str, reasoning: str | None, content: str) -> None:
    assert ReasoningParser.split(kind, text) == (reasoning, content)


@pytest.mark.parametrize("kind,text,reasoning,content", CASES)
def test_stream_every_cutting(kind: str, text: str, reasoning: str | None, content: str) -> None:
    expected = (reasoning or "", content)
    assert _stream(kind, [text]) == expected
    assert _stream(kind, list(text)) == expected  # one character at a time
    assert _stream(kind, ["", *(c for ch in text for c in (ch, ""))]) == expected  # with empty deltas
    for i in range(len(text) + 1):  # every single cut point
        assert _stream(kind, [text[:i], text[i:]]) == expected


def test_holds_back_partial_tags() -> None:
    p = ReasoningParser("deepseek_r1")
    assert p.feed("abc</thi") == ("abc", "")
    assert p.feed("nk>") == ("", "")  # the "\n" (or "\n\n") after the close may still come
    assert p.feed("\n") == ("", "")
    assert p.feed("\nHi") == ("", "Hi")
    assert p.feed("<think>") == ("", "<think>")
    assert p.finish() == ("", "")

    q = ReasoningParser("qwen3")
    assert q.feed("  <th") == ("", "")
    assert q.feed("e") == ("", "  <the")  # not a tag after all: all content
    assert q.finish() == ("", "")

    q = ReasoningParser("qwen3")
    assert q.feed("<think>\nr</") == ("r", "")
    assert q.finish() == ("</", "")


def test_custom_tags() -> None:
    p = ReasoningParser("qwen3", start="<reason>", end="</reason>")
    assert p.feed("<reason>x</reas") == ("x", "")
    assert p.feed("on>y") == ("", "y")
    assert p.finish() == ("", "")


def test_unknown_kind() -> None:
    assert REASONING_PARSERS == ("deepseek_r1", "qwen3")
    with pytest.raises(ValueError, match="nope"):
        ReasoningParser("nope")
    with pytest.raises(ValueError, match="nope"):
        ReasoningParser.split("nope", "x")


PIECES = ["<think>", "</think>", "<th", "ink>", "\n", "\n\n", " ", "a", "é", "</", "think", ">", "<"]


@settings(max_examples=500, deadline=None)
@given(
    kind=st.sampled_from(REASONING_PARSERS),
    pieces=st.lists(st.sampled_from(PIECES), max_size=14),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=8),
)
def test_stream_equals_split(kind: str, pieces: list[str], cuts: list[int]) -> None:
    text = "".join(pieces)
    points = sorted(c % (len(text) + 1) for c in cuts)  # repeated points give empty deltas
    bounds = [0, *points, len(text)]
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    reasoning, content = ReasoningParser.split(kind, text)
    assert _stream(kind, deltas) == (reasoning or "", content)
    if kind == "deepseek_r1":
        assert reasoning is not None
    # nothing is lost except tags, leading whitespace before <think> and the documented newlines
    assert len((reasoning or "") + content) <= len(text)
