"""Turn a stream of token ids into text deltas, one request at a time.

Decoding each token on its own is wrong twice over: a UTF-8 character can span
several byte tokens (a lone piece decodes to U+FFFD), and SentencePiece-style
decoders drop a leading space at the start of the text they decode. So each step
decodes a short window: context tokens (whose text was already emitted) plus the
pending ones, and emits the part of the text not yet shown. A window that does
not start at the very beginning of the stream is decoded behind an anchor token
with visible text, so no decoder treats it as the start of the text.

Only the trailing U+FFFDs can still change: an incomplete character waiting for
its remaining bytes (at most 3, which a decoder renders as one U+FFFD or one per
byte); every earlier byte decodes the same whatever follows. So a step shows the
text before them and keeps the tokens pending. When the text ends
cleanly the pending tokens become the next context. The deltas therefore join to
`tokenizer.decode(all_ids)` for any ids, malformed bytes included, unless a
character stays incomplete for more than MAX_PENDING tokens; then the window is
cut and the text emitted as decode gives it. Per step the work is O(window).
"""

from __future__ import annotations

from collections.abc import Sequence

from llmserve.engine.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
MAX_INCOMPLETE = 3  # bytes of a UTF-8 character that can wait for the rest of it
MAX_PENDING = 64  # tokens kept while the text ends in U+FFFD (bounds a step's decode on garbage output)
MAX_CONTEXT = 4  # context tokens kept: enough for a decoder's spacing rules
MAX_INVISIBLE = 32  # tokens with no text (skipped specials) kept in the window before it is cut


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()) -> None:
        """prompt_ids: optional prompt tail; its last tokens give the first output token its leading space."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.num_tokens = 0
        self._window: list[int] = list(prompt_ids[-MAX_CONTEXT:])  # context tokens, then pending ones
        self._read = len(self._window)  # window[:_read] is context: its text was emitted (or is the prompt's)
        self._at_start = not self._window  # the window starts at the first token of the text
        self._shown = self._decode(self._window) if self._window else ""  # the window's text emitted so far
        self._context_chars = len(self._shown)  # the part of _shown that is the context's

    def _decode(self, ids: list[int]) -> str:
        if self._at_start:
            return self.tokenizer.decode(ids, self.skip_special_tokens)
        anchor_ids, anchor_text = self.tokenizer.context_anchor
        return self.tokenizer.decode(anchor_ids + ids, self.skip_special_tokens)[len(anchor_text) :]

    def _show(self, text: str) -> str:
        """Emit the part of the window's text past what was shown."""
        delta = text[len(self._shown) :]
        self._shown += delta
        self.text += delta
        return delta

    def _set_context(self, start: int) -> None:
        """window[start:] (its last MAX_CONTEXT tokens) becomes the context of the next step."""
        self._window = self._window[max(start, len(self._window) - MAX_CONTEXT) :]
        self._read = len(self._window)
        self._at_start = False
        self._shown = self._decode(self._window)
        self._context_chars = len(self._shown)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add generated tokens; return the text they complete (may be "" while a character is incomplete)."""
        if not new_token_ids:
            return ""
        self._window.extend(new_token_ids)
        self.num_tokens += len(new_token_ids)
        text = self._decode(self._window)
        pending = len(self._window) - self._read
        if text.endswith(REPLACEMENT) and pending <= MAX_PENDING:
            # The last character may be incomplete: show what precedes it, unless the decoder
            # rewrote text already shown (byte-fallback decoders do), then wait for a clean end.
            stable = text[:-MAX_INCOMPLETE] + text[-MAX_INCOMPLETE:].rstrip(REPLACEMENT)
            return self._show(stable) if text.startswith(self._shown) else ""
        return self._complete(text)

    def _complete(self, text: str) -> str:
        """The window's text is final: emit the rest and move the context forward."""
        delta = self._show(text)
        if len(self._shown) > self._context_chars:
            self._set_context(self._read)  # the pending tokens' text is out: they are the next context
        elif len(self._window) - self._read > MAX_INVISIBLE:
            self._set_context(len(self._window) - 1)  # a long run with no text: drop the old context
        return delta

    def finish(self) -> str:
        """End of stream: emit whatever is held (invalid trailing bytes come out as decode gives them)."""
        if self._read == len(self._window):
            return ""
        return self._complete(self._decode(self._window))
