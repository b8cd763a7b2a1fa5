"""Split a reasoning model's output text into ``reasoning_content`` and ``content``, whole or streamed.

Kinds (the models think inside ``<think>…</think>`` before answering; one reasoning block only):
  deepseek_r1  R1's chat template already ends the prompt with ``<think>\\n``, so the output starts inside the
               reasoning: text is reasoning until ``</think>``, then content. A ``<think>`` at the very start
               (after optional whitespace) is dropped, since some R1 distills emit it. If ``</think>`` never
               comes, everything is reasoning and content is "" (vLLM's R1 behaviour). Reasoning is always a
               string (maybe "").
  qwen3        reasoning only when the output starts (after optional whitespace) with ``<think>``; then text is
               reasoning until ``</think>`` (or the end of the output), then content. Otherwise everything,
               leading whitespace included, is content and ``split`` gives reasoning None.
Exactly what is stripped, nothing else (trailing newlines of the reasoning are kept):
  - both tags, and any whitespace before a leading ``<think>``;
  - ONE "\\n" right after the opening ``<think>`` (deepseek_r1 without it: one "\\n" at the start of the output);
  - "\\n\\n", or else "\\n", directly after ``</think>`` (the start of the content).
A ``<think>``/``</think>`` after the reasoning block is plain content. Streaming (``feed``/``finish``) gives the
same concatenated result as ``split`` for any cutting of the text into deltas: text that may still become a
tag (or a strippable newline) is held back until it is certain.
"""

from __future__ import annotations

REASONING_PARSERS = ("deepseek_r1", "qwen3")

_START, _AFTER_OPEN, _REASONING, _AFTER_CLOSE, _CONTENT = range(5)


def _check(kind: str) -> None:
    if kind not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {kind!r}; known: {', '.join(REASONING_PARSERS)}")


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (0 when none): text held
    back while a tag may be arriving (here and in tool_calls.py)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    """Streaming splitter: one instance per output (per choice), fed its text deltas in order."""

    def __init__(self, kind: str, start: str = "<think>", end: str = "</think>") -> None:
        _check(kind)
        if not start or not end:
            raise ValueError("reasoning tags must be non-empty")
        self.kind, self.start, self.end = kind, start, end
        self._state = _START
        self._pending = ""  # text received but not yet given out

    def feed(self, delta: str) -> tuple[str, str]:
        """Take the next piece of output text; return (reasoning delta, content delta) that are now certain.
        Text that may be the beginning of a tag (e.g. "</thi" at the end of a delta) is held back until the
        next feed or finish()."""
        self._pending += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """End of output: flush what was held back (a partial tag that never completed is text)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            p = self._pending
            if self._state == _START:  # does the output open with `start` (after whitespace)?
                s = p.lstrip()
                if s.startswith(self.start):
                    self._pending, self._state = s[len(self.start) :], _AFTER_OPEN
                elif not final and (not s or self.start.startswith(s)):
                    break
                else:
                    self._state = _AFTER_OPEN if self.kind == "deepseek_r1" else _CONTENT
            elif self._state == _AFTER_OPEN:  # strip one "\n"
                if not p and not final:
                    break
                self._pending, self._state = p.removeprefix("\n"), _REASONING
            elif self._state == _REASONING:
                i = p.find(self.end)
                if i >= 0:
                    reasoning.append(p[:i])
                    self._pending, self._state = p[i + len(self.end) :], _AFTER_CLOSE
                    continue
                cut = len(p) - (0 if final else partial_tag(p, self.end))
                reasoning.append(p[:cut])
                self._pending = p[cut:]
                break
            elif self._state == _AFTER_CLOSE:  # strip "\n\n" or "\n"
                if p in ("", "\n") and not final:
                    break
                self._pending = p[2:] if p.startswith("\n\n") else p.removeprefix("\n")
                self._state = _CONTENT
            else:
                content.append(p)
                self._pending = ""
                break
        return "".join(reasoning), "".join(content)

    @staticmethod
    def split(kind: str, text: str) -> tuple[str | None, str]:
        """Whole (non-streamed) text -> (reasoning_content or None when the model did not reason, content).
        Uses the default tags ``<think>``/``</think>``."""
        _check(kind)
        stripped = text.lstrip()
        if stripped.startswith("<think>"):
            rest = stripped[len("<think>") :]
        elif kind == "qwen3":
            return None, text
        else:
            rest = text
        reasoning, closed, content = rest.removeprefix("\n").partition("</think>")
        if closed:
            content = content[2:] if content.startswith("\n\n") else content.removeprefix("\n")
        return reasoning, content
