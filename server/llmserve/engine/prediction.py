"""OpenAI's predicted outputs (`prediction`) as speculative proposals: a request whose output will mostly
repeat a known text (an edit of a file, say) is given that text's next tokens as drafts, which the runner
verifies losslessly like any other proposal. Matched output then costs one step per k + 1 tokens.

The alignment: where the prediction continues the output. It is kept per request and checked against the
tokens the request took in; where they part (the edit), the longest suffix (<= MAX_N tokens) of the output
found in the prediction, at or after the last alignment if it occurs there, realigns it.
"""

from __future__ import annotations

from llmserve.engine.request import Request
from llmserve.engine.speculative import Proposer

MAX_N = 3  # longest output suffix looked up to realign after the output left the prediction


def find(seq: list[int], pattern: list[int], start: int = 0) -> int | None:
    """The first index i >= start with seq[i : i + len(pattern)] == pattern."""
    n, first = len(pattern), pattern[0]
    for i in range(max(0, start), len(seq) - n + 1):
        if seq[i] == first and seq[i : i + n] == pattern:
            return i
    return None


class PredictionProposer(Proposer):
    def __init__(self) -> None:
        self._at: dict[str, tuple[int, int]] = {}  # req_id -> (output tokens seen, index in the prediction)

    def propose(self, reqs: list[Request], k: int) -> None:
        for req in reqs:
            req.draft_token_ids = self.next_tokens(req.req_id, req.params.prediction_token_ids, req.output_token_ids, k)

    def next_tokens(self, req_id: str, pred: list[int], out: list[int], k: int) -> list[int]:
        """Up to k tokens of the prediction that follow the output so far (empty: it no longer aligns)."""
        seen, at = self._at.get(req_id, (0, 0))
        while seen < len(out) and at is not None and at < len(pred) and pred[at] == out[seen]:
            seen, at = seen + 1, at + 1  # the output kept to the prediction
        if seen < len(out):  # it parted from it: realign on the output's last tokens
            at = None
            for n in range(min(MAX_N, len(out)), 0, -1):
                i = find(pred, out[-n:], self._at.get(req_id, (0, 0))[1] - n)
                i = find(pred, out[-n:]) if i is None else i
                if i is not None:
                    at = i + n
                    break
            seen = len(out)
        if at is None:
            self._at[req_id] = (seen, len(pred))  # nothing to propose until it realigns
            return []
        self._at[req_id] = (seen, at)
        return pred[at : at + k]

    def drop(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            self._at.pop(rid, None)
