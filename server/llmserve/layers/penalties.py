"""Penalty state of the device sampler: per-request output counts and prompt-seen masks, on the device."""

from __future__ import annotations

import torch

from llmserve.engine.request import Request


class PenaltyState:
    """Per-request token counts on the device: output counts and a prompt-seen mask.

    A request's row is filled once, from its prompt and the output it already has (preempted
    requests keep their row); after that each token drawn for it is counted on the device as it
    is drawn, so the counts never wait for the host to learn the tokens (overlapped steps)."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self.seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self.row: dict[str, int] = {}
        self.free: list[int] = []

    def _grow(self) -> None:
        n = max(8, 2 * self.counts.shape[0])
        old = self.counts.shape[0]
        self.counts = torch.cat([self.counts, self.counts.new_zeros(n - old, self.vocab)])
        self.seen = torch.cat([self.seen, self.seen.new_zeros(n - old, self.vocab)])
        self.free.extend(range(n - 1, old - 1, -1))

    def drop(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            r = self.row.pop(rid, None)
            if r is not None:
                self.counts[r].zero_()
                self.seen[r].zero_()
                self.free.append(r)

    def rows(self, reqs: list[Request]) -> torch.Tensor:
        """State rows of `reqs`, filling those seen for the first time."""
        rows, seen_r, seen_t, cnt_r, cnt_t = [], [], [], [], []
        for req in reqs:
            r = self.row.get(req.req_id)
            if r is None:
                if not self.free:
                    self._grow()
                r = self.row[req.req_id] = self.free.pop()
                seen_t.extend(req.prompt_token_ids)
                seen_r.extend([r] * len(req.prompt_token_ids))
                cnt_t.extend(req.output_token_ids)
                cnt_r.extend([r] * len(req.output_token_ids))
            rows.append(r)
        if seen_t:
            idx = torch.tensor([seen_r, seen_t], dtype=torch.int64).to(self.device, non_blocking=True)
            self.seen[idx[0], idx[1]] = True
        if cnt_t:
            self.count(torch.tensor(cnt_r, dtype=torch.int64), torch.tensor(cnt_t, dtype=torch.int64))
        return torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)

    def count(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        rows, tokens = rows.to(self.device, non_blocking=True), tokens.to(self.device, non_blocking=True)
        self.counts.index_put_((rows, tokens), torch.ones_like(rows, dtype=torch.int32), accumulate=True)
