"""What the engine server sends for a request: native response items and their logprob entries.

A request in flight is a `Live`: who asked, its text so far, what was sent. Each step's new
tokens become one item (streaming) or are kept for the last one. Logprob entries are spelled
here, where the tokenizer is, so no adapter or front end needs one:

  {"token_id", "token", "bytes", "logprob", "text_offset", "top": [{"token_id", "token", "bytes", "logprob"}]}

`token` is the token on its own (decoded with special tokens; a piece of a UTF-8 character
shows as U+FFFD), `bytes` its raw bytes (`top` leaves out tokens a grammar or a bias masked: their
logprob is -inf, which no strict JSON parser takes; as vLLM does), `text_offset` where its text starts in the request's
whole output text: the length of the detokenized text before it, so that it is the same
however the tokens were split into steps or responses. Prompt entries (`prompt_logprobs`)
count offsets in `prompt_text`; the first has `logprob` and `top` null.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.engine.output_processor import TextState
from llmserve.protocol import native

MASKED_LOGPROB = -9999.0  # a chosen token's -inf / NaN logprob as strict JSON can carry it (vLLM's clamp)


@dataclass
class Live:
    """A request in flight: who asked, its text so far, and what was sent."""

    client: bytes
    req: native.NativeRequest
    core_id: str  # the core's id of it: unique, so a req_id reused at once never takes an old one's tokens
    text_state: TextState
    prompt_ids: list[int]
    arrival: float
    deadline: float
    num_output_tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # without streaming only (sent at the end)
    logprobs: list[dict] = field(default_factory=list)  # the same, when asked: one entry per token
    prompt: dict | None = None  # prompt_text / prompt_logprobs, until the item that carries them
    first_token_time: float | None = None
    told_prompt: bool = False  # return_usage: the first item carries `prompt_tokens`


class Speller:
    """Token spellings for logprob entries (cached: the same ids come back often)."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def spell(self, token_id: int) -> tuple[str, list[int]]:
        s = self.cache.get(token_id)
        if s is None:
            if len(self.cache) > 200_000:
                self.cache.clear()
            s = self.cache[token_id] = (
                self.tok.decode([token_id], skip_special_tokens=False),
                list(self.tok.decode_token_bytes(token_id)),
            )
        return s

    def entry(self, token_id: int, logprob: float | None, top: list | None, offset: int) -> dict:
        text, raw = self.spell(token_id)
        tops = None
        if top is not None:
            tops = []
            for t, lp in top:
                if not math.isfinite(lp):  # masked (-inf) or NaN: not a candidate, and not JSON
                    continue
                t_text, t_raw = self.spell(t)
                tops.append({"token_id": t, "token": t_text, "bytes": t_raw, "logprob": lp})
        return {
            "token_id": token_id,
            "token": text,
            "bytes": raw,
            "logprob": logprob if logprob is None or math.isfinite(logprob) else MASKED_LOGPROB,
            "text_offset": offset,
            "top": tops,
        }

    def prompt(self, ids: list[int], lps: list | None) -> dict:
        """`prompt_text` (the prompt decoded) and, when computed, `prompt_logprobs` (an entry per token)."""
        # Special tokens kept, as vLLM (and HF's decode) echo a token-id prompt: else a prompt of special
        # ids echoes as nothing.
        detok = IncrementalDetokenizer(self.tok, skip_special_tokens=False)
        text, offsets = "", []
        for t in ids:
            offsets.append(len(text))
            text += detok.step([t])
        text += detok.finish()
        out: dict = {"prompt_text": text}
        if lps is not None:
            out["prompt_logprobs"] = [
                self.entry(t, None if lp is None else lp[0], None if lp is None else lp[1], off)
                for t, lp, off in zip(ids, lps, offsets)
            ]
        return out


def item(
    lv: Live,
    stream: bool,
    new_ids: list[int],
    new_text: str,
    logprobs: list[dict],
    reason: str | None,
    num_cached: int,
) -> dict:
    """One item: this step's tokens (and their logprobs) when streaming, else all of them."""
    out = {
        "req_id": lv.req.req_id,
        "token": new_text if stream else lv.text,
        "token_ids": new_ids if stream else lv.token_ids,
        "is_end": int(reason is not None),
        "error_code": 0,
        "error_msg": "",
    }
    if lv.req.logprobs is not None:  # an entry per token
        out["logprobs"] = logprobs if stream else lv.logprobs
    if lv.req.return_usage and not lv.told_prompt:  # usage so far, before the last item (OpenAI's continuous)
        out["prompt_tokens"] = len(lv.prompt_ids)
        lv.told_prompt = True
    if lv.prompt is not None:  # the first item sent carries the prompt's text and logprobs
        out.update(lv.prompt)
        lv.prompt = None
    if reason is not None:
        out["tokens_all"] = lv.text
        out["finish_reason"] = reason
        if lv.req.return_usage:
            out["usage"] = native.usage(len(lv.prompt_ids), lv.num_output_tokens, num_cached)
    return out
