"""Tool calls in a model's output: parsed into OpenAI `tool_calls`, streamed, and grammars that force them.

One parser per format models use, chosen by TOOL_CALL_PARSER:
  hermes       <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call> blocks (Hermes, Qwen2/2.5/3);
               text outside the blocks is content
  llama3_json  the whole output one JSON object {"name": ..., "parameters": {...}} (or several joined by
               "; "), optionally after <|python_tag|> (Llama 3.1/3.2/3.3's JSON tool calling)
A block that does not parse as a call stays content (nothing is lost). Streaming holds back what may be
a call until it is complete, then sends it as OpenAI streams calls: its id, type and name first, then
its arguments. `grammar` gives the Lark grammar (llguidance) whose every sentence is one call (or
several, `parallel`) of the given tools in the format, arguments valid against their schemas:
tool_choice "required" or a named function.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from llmserve.protocol.reasoning import partial_tag

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_NO_FREE_WHITESPACE = {"whitespace_flexible": False}


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj: object, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class ToolCallParser:
    def __init__(self, kind: str) -> None:
        if kind not in TOOL_CALL_PARSERS:
            raise ValueError(f"TOOL_CALL_PARSER={kind!r}: expected one of {', '.join(TOOL_CALL_PARSERS)}")
        self.kind = kind
        self.buf = ""  # text not sent yet: a call (or what may start one) in progress
        self.calls: list[ToolCall] = []
        self._content_sent = False
        self._after_call = False  # a hermes block just ended: one newline after it is no content

    # ---- whole outputs -------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output."""
        content, calls = self.feed(text)
        tail, more = self.finish()
        return content + tail, calls + more

    # ---- streaming -----------------------------------------------------------------------
    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Content that is now certain, and calls now complete."""
        self.buf += delta
        return self._hermes(final=False) if self.kind == "hermes" else self._llama3(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._hermes(final=True) if self.kind == "hermes" else self._llama3(final=True)

    def _hermes(self, final: bool) -> tuple[str, list[ToolCall]]:
        start, end = "<tool_call>", "</tool_call>"
        content, calls = "", []
        while True:
            if self._after_call and self.buf:  # the newline that separates a call from what follows
                self.buf, self._after_call = self.buf.removeprefix("\n"), False
            i = self.buf.find(start)
            if i < 0:
                keep = 0 if final else partial_tag(self.buf, start)
                content += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep :]
                break
            content += self.buf[:i]
            j = self.buf.find(end, i)
            if j < 0:
                if final:  # never closed: the text is content
                    content += self.buf[i:]
                    self.buf = ""
                else:
                    self.buf = self.buf[i:]
                break
            body = self.buf[i + len(start) : j]
            call = _call(_loads(body.strip()), "arguments")
            if call is None:
                content += self.buf[i : j + len(end)]
            else:
                calls.append(call)
                self._after_call = True
            self.buf = self.buf[j + len(end) :]
        return self._emit(content, calls)

    def _llama3(self, final: bool) -> tuple[str, list[ToolCall]]:
        text = self.buf.removeprefix("<|python_tag|>").strip()
        maybe_call = not self._content_sent and (
            not text or text.startswith("{") or "<|python_tag|>".startswith(self.buf)
        )
        if not final and maybe_call:
            return "", []  # may be a call: wait for the whole output
        out, self.buf = self.buf, ""
        if final and maybe_call and text:
            calls = [_call(_loads(part), "parameters") for part in text.split("; ")]
            if all(c is not None for c in calls):
                return self._emit("", calls)
        return self._emit(out, [])

    def _emit(self, content: str, calls: list[ToolCall]) -> tuple[str, list[ToolCall]]:
        self._content_sent |= bool(content.strip())
        self.calls += calls
        return content, calls


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def stream_deltas(calls: list[ToolCall], first_index: int) -> list[dict]:
    """OpenAI streaming `tool_calls` deltas: per call its id, type and name, then its arguments."""
    out = []
    for k, c in enumerate(calls, first_index):
        out.append({"index": k, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}})
        out.append({"index": k, "function": {"arguments": c.arguments}})
    return out


def grammar(kind: str, tools: list[dict], parallel: bool) -> str:
    """Lark (llguidance) of one call, or of one or more (`parallel`), of `tools` (OpenAI function tools)
    in format `kind`, arguments valid against each function's `parameters`."""
    one_of = []
    for t in tools:
        f = t["function"]
        params = f.get("parameters") or {"type": "object"}
        key = "parameters" if kind == "llama3_json" else "arguments"
        one_of.append({
            "type": "object",
            "properties": {"name": {"const": f["name"]}, key: params},
            "required": ["name", key],
            "additionalProperties": False,
        })  # fmt: skip
    schema = json.dumps({"anyOf": one_of, "x-guidance": _NO_FREE_WHITESPACE})
    if kind == "hermes":
        call = f'"<tool_call>\\n" %json {schema} "\\n</tool_call>"'
        return f'start: call ("\\n" call)*\ncall: {call}' if parallel else f"start: {call}"
    return f'start: call ("; " call)*\ncall: %json {schema}' if parallel else f"start: %json {schema}"
