"""Structured output in the engine: one llguidance matcher per constrained request.

Before a step samples a constrained request, its matcher writes the tokens the grammar allows next
into a bitmask (one bit per token id, int32 words), which the runner applies to the logits where it
samples (the device for the torch runner): every other token gets -inf. Each token taken in then
advances the matcher; when the grammar is complete the request ends (finish reason "stop"). The
matchers need the model's tokenizer (its tokens' bytes), built once, when the first constrained
request arrives.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from functools import partial

import numpy as np

from llmserve.engine.request import Request

log = logging.getLogger(__name__)

COMPILED_GRAMMARS = 256  # grammars kept compiled (least recently used go first)


def _llguidance():
    """The grammar engine, or a ValueError naming the package (the request is refused, the engine serves on)."""
    try:
        import llguidance
    except ImportError as e:
        raise ValueError(
            "structured output needs the package llguidance, which is not installed on this server "
            f"(pip install llguidance): {e}"
        ) from None
    return llguidance


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads of a tokenizer."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tok = tokenizer
        n = tokenizer.vocab_size
        # Ids past the tokenizer's (a model's padded vocabulary) stand for no bytes: never allowed.
        self.tokens = [tokenizer.decode_token_bytes(i) for i in range(n)] + [b""] * max(0, vocab_size - n)
        eos = sorted(eos_token_ids) or sorted(tokenizer.eos_token_ids)
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_token_ids)

    def __call__(self, s: bytes | str) -> list[int]:
        text = s.decode("utf-8", "replace") if isinstance(s, bytes) else s
        return self.tok.encode(text, add_special_tokens=False)


def allowed_tokens(words: np.ndarray, vocab: int) -> np.ndarray:
    """A bitmask's bits as booleans [vocab] (host samplers)."""
    return np.unpackbits(np.ascontiguousarray(words, np.int32).view(np.uint8), bitorder="little")[:vocab].astype(bool)


class GrammarMatchers:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self._ll = None  # llguidance.LLTokenizer, built on first use
        self.matchers: dict[str, object] = {}
        self.words = -(-vocab_size // 32)
        # One fresh matcher per grammar, compiled once: requests with the same schema start from a copy.
        self._compiled: OrderedDict[str, object] = OrderedDict()

    def _lltokenizer(self):
        if self._ll is None:
            llguidance = _llguidance()
            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer, and this engine has none")
            vocab = _Vocabulary(self.tokenizer, self.vocab_size, self.eos_token_ids)
            self._ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab))
        return self._ll

    def add(self, req: Request) -> None:
        """A matcher for a request with a grammar; ValueError when it cannot run on this tokenizer."""
        llguidance = _llguidance()
        g = req.params.grammar
        fresh = self._compiled.get(g)
        if fresh is None:
            fresh = llguidance.LLMatcher(self._lltokenizer(), g)
            if fresh.is_error():
                raise ValueError(f"structured output: {fresh.get_error()}")
            self._compiled[g] = fresh
            if len(self._compiled) > COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(g)
        self.matchers[req.req_id] = fresh.deep_copy()

    def active(self) -> bool:
        return bool(self.matchers)

    def attach(self, chunks: list) -> None:
        """Give each sampling chunk of a constrained request its bitmask, as a closure the runner calls
        when it samples (so the mask is computed while the device runs the model)."""
        if not self.matchers:
            return
        for c in chunks:
            if c.sample and c.request.req_id in self.matchers:
                c.token_bitmask = partial(self.bitmask, c.request.req_id, list(c.draft_token_ids))

    def bitmask(self, req_id: str, drafts: list[int] = ()) -> np.ndarray:
        """Rows of int32 words, bit t of word t // 32 set when token t may come next: row j after the
        request's tokens and drafts[:j] (speculative decoding verifies 1 + k positions). Drafts past the
        first one the grammar refuses get all-ones rows: the draw before them cannot be that draft, so
        their rows are never used. The matcher is left as it was (rolled back)."""
        m = self.matchers[req_id]
        rows = np.full((1 + len(drafts), self.words), -1, dtype=np.int32)
        ok = m.validate_tokens(list(drafts)) if drafts else 0
        for j in range(ok + 1):
            rows[j] = self._words(m)
            if j < ok:
                m.consume_token(drafts[j])
        if ok:
            m.rollback(ok)
        return rows

    def _words(self, m) -> np.ndarray:
        words = np.frombuffer(m.compute_bitmask(), dtype=np.int32)
        if words.size < self.words:  # the tokenizer's vocabulary is smaller than the model's
            words = np.concatenate([words, np.zeros(self.words - words.size, np.int32)])
        words = words[: self.words]
        return words if words.any() else np.full(self.words, -1, np.int32)  # complete: nothing is -inf'd

    def accept(self, req_id: str, token: int) -> bool:
        """Advance the request's matcher by `token`; True when the grammar is complete (or broken:
        logged, the request ends rather than go on unconstrained)."""
        m = self.matchers.get(req_id)
        if m is None:
            return False
        if not m.consume_token(token):
            log.error("request %s: token %d breaks its grammar (%s); ending it", req_id, token, m.get_error())
            return True
        return m.is_stopped()

    def drop(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)
