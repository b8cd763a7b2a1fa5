"""Turn a stream of token ids into text deltas, one request at a time.

Decoding each token on its own is wrong twice over: a UTF-8 character can span
several byte tokens (a lone piece decodes to U+FFFD), and SentencePiece-style
decoders drop a leading space at the start of the text they decode. So each step
decodes a short window: the tokens of the previous delta (context) plus the new
ones, and emits the part past the context's text. A window that does not start
at the very beginning of the stream is decoded behind an anchor token with
visible text, so no decoder treats it as the start of the text.

Text ending in U+FFFD is held (an incomplete character waits for its remaining
bytes) for at most MAX_HOLD tokens; past that, or at `finish()`, it is emitted
as decode gives it. For well-formed output the deltas join to
`tokenizer.decode(all_ids)`. Per step the work is O(window), not O(output).
"""

from __future__ import annotations

from collections.abc import Sequence

from llmserve.engine.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
MAX_HOLD = 8  # a UTF-8 character has at most 4 bytes; allow for interleaved special tokens
MAX_INVISIBLE = 32  # tokens with no text (skipped specials) kept in the window before it is cut


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()) -> None:
        """prompt_ids: optional prompt tail; its last tokens give the first output token its leading space."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.num_tokens = 0
        self._window: list[int] = list(prompt_ids[-4:])  # context tokens, then tokens not yet emitted
        self._read = len(self._window)  # window[:_read] is context whose text was emitted (or is the prompt's)
        self._at_start = not self._window  # the window starts at the first token of the text

    def _decode(self, ids: list[int]) -> str:
        if self._at_start:
            return self.tokenizer.decode(ids, self.skip_special_tokens)
        anchor_ids, anchor_text = self.tokenizer.context_anchor
        return self.tokenizer.decode(anchor_ids + ids, self.skip_special_tokens)[len(anchor_text) :]

    def _emit(self, upto: int, text: str) -> str:
        """Emit the text of window[_read:upto]; those tokens become the next context."""
        delta = text[len(self._decode(self._window[: self._read])) :]
        if delta:
            self._window = self._window[self._read :]
            self._read = upto - self._read
            self._at_start = False
        elif upto - self._read > MAX_INVISIBLE:  # a long run with no text: drop the old context
            self._window = self._window[upto - 1 :]
            self._read = 1
            self._at_start = False
        self.text += delta
        return delta

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add generated tokens; return the text they complete (may be "" while a character is incomplete)."""
        if not new_token_ids:
            return ""
        self._window.extend(new_token_ids)
        self.num_tokens += len(new_token_ids)
        n = len(self._window)
        text = self._decode(self._window)
        if not text.endswith(REPLACEMENT):
            return self._emit(n, text)
        # The tail may be an incomplete character: emit up to the last token boundary that ends cleanly.
        for upto in range(n - 1, max(self._read, n - MAX_HOLD - 1), -1):
            head = self._decode(self._window[:upto])
            if not head.endswith(REPLACEMENT):
                return self._emit(upto, head)
        if n - self._read <= MAX_HOLD:
            return ""  # hold: wait for the rest of the character
        return self._emit(n, text)  # held too long: the bytes are invalid, emit them as decode does

    def finish(self) -> str:
        """End of stream: emit whatever is held (invalid trailing bytes come out as decode gives them)."""
        if self._read == len(self._window):
            return ""
        return self._emit(len(self._window), self._decode(self._window))
