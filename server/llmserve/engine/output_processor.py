"""Turns sampled tokens into text deltas and decides when a request stops.

Stop strings are matched on the detokenized text; while a request runs, the
last `len(longest stop) - 1` characters are held back so a stop string that
straddles two steps is never streamed out and then taken back.
"""

from __future__ import annotations

from llmserve.engine.request import FinishReason, Request
from llmserve.engine.sampling_params import SamplingParams


class TextState:
    """Per-request text: an incremental detokenizer plus what was already emitted.

    It needs only the request's params, so it runs wherever the text is wanted: in the engine
    (offline use) or in the engine server's front process, off the step loop."""

    def __init__(self, params: SamplingParams, tokenizer) -> None:
        self.params = params
        self.detok = None
        if tokenizer is not None:
            from llmserve.engine.detokenizer import IncrementalDetokenizer

            self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
        self.text = ""
        self.emitted = 0
        self.stopped_by_string = False
        stops = params.stop
        self.holdback = max((len(s) for s in stops), default=1) - 1

    def append(self, token_ids: list[int]) -> FinishReason | None:
        """Add new tokens' text; return STOP when a stop string appeared."""
        if self.detok is None:
            return None
        start = len(self.text)
        self.text += self.detok.step(token_ids)
        stops = self.params.stop
        if not stops:
            return None
        # Only the new text (plus the tail that could join it) can hold a new match.
        search_from = max(0, start - self.holdback)
        best: tuple[int, str] | None = None
        for s in stops:
            k = self.text.find(s, search_from)
            if k != -1 and (best is None or k < best[0]):
                best = (k, s)
        if best is None:
            return None
        k, s = best
        self.stopped_by_string = True
        self.text = self.text[: k + len(s)] if self.params.include_stop_str_in_output else self.text[:k]
        return FinishReason.STOP

    def flush_text(self, finished: bool) -> str:
        """The text not yet emitted, keeping back a possible partial stop string unless finished."""
        if finished and self.detok is not None and not self.stopped_by_string:
            self.text += self.detok.finish()  # bytes of an unfinished character, as decode renders them
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta


def check_stop_token(req: Request, token: int, max_model_len: int) -> FinishReason | None:
    if token in req.eos_token_ids and len(req.output_token_ids) >= req.params.min_tokens:
        return FinishReason.STOP
    if len(req.output_token_ids) >= req.params.max_tokens or req.num_known_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
