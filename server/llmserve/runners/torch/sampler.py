"""Sampling on the device: logit bias, penalties, min length, temperature, top-k, top-p, seeds.

Same definitions as the host sampler (engine/sampler.py): logit_bias added to
the raw logits before anything else, repetition penalty
over prompt + output tokens (logit / p when positive, logit * p otherwise),
frequency/presence penalties over output tokens, eos/stop ids masked until
min_tokens, temperature 0 = greedy, top-k then top-p (the nucleus keeps the
tokens whose preceding mass is under top_p, at least one), logprobs of the
penalised logits. Draws use the Gumbel-max trick with noise hashed from
(request seed, output index, token id) (kernels/sampling.py), so a seeded
request reproduces in any batch and no request needs its own generator.

Per step the host uploads one small parameter block; penalty counts live on
the device per request and are updated with each request's new tokens, so a
penalised request costs O(new tokens) host work per step, not O(length).
"""

from __future__ import annotations

import random

import numpy as np
import torch

from llmserve.engine.request import Request
from llmserve.engine.sampler import bias_arrays
from llmserve.runners.base import SeqChunk, TokenLogprobs

from .kernels.sampling import gumbel_argmax, mix_key


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


class DeviceSampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab = vocab_size
        self.device = device
        self.penalties = PenaltyState(vocab_size, device)
        self._seed_rng = random.Random(seed)
        self._seeds: dict[str, int] = {}  # engine-drawn seeds of requests without their own
        # req_id -> (its logit_bias dict, [2, n] float64 host block of token ids and biases): built
        # once per request, as its bias never changes.
        self._bias: dict[str, tuple[dict[int, float], np.ndarray]] = {}

    def drop(self, req_ids: list[str]) -> None:
        self.penalties.drop(req_ids)
        # Unseeded requests keep their drawn seed across preemption: it is only forgotten
        # when the request is gone (a new request with the same id draws afresh).
        for rid in req_ids:
            self._seeds.pop(rid, None)
            self._bias.pop(rid, None)

    def _seed(self, req: Request) -> int:
        if req.params.seed is not None:
            return req.params.seed
        s = self._seeds.get(req.req_id)
        if s is None:
            s = self._seeds[req.req_id] = self._seed_rng.getrandbits(63)
        return s

    def sample(
        self, logits: torch.Tensor, reqs: list[Request], out_index: list[int] | None = None
    ) -> tuple[torch.Tensor, object]:
        """logits [N, V] float32 (modified in place) -> token ids [N] on the device, and a function
        of those tokens giving the logprobs (host lists; None when none were asked for).

        out_index[i]: the output index of the token drawn for reqs[i] (default: its output length).
        It keys seeded draws and min_tokens; it is given because with overlapped steps the request's
        last tokens may not be known to the host yet."""
        if out_index is None:
            out_index = [len(r.output_token_ids) for r in reqs]
        tokens, lps, pen = self._sample(logits, reqs, out_index, None)
        if pen is not None:  # count the drawn tokens of penalised requests, on the device
            self.penalties.count(pen[1], tokens[pen[0]])
        return tokens, lps

    def verify(
        self, logits: torch.Tensor, chunks: list[SeqChunk], out_index: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, object]:
        """Sampling chunks with drafts (runners/base.py): logits [R, V], each chunk's
        `num_sampled_rows` rows in turn; out_index[i]: output index of chunk i's first row.
        Row j is drawn as `sample` draws it with drafts[:j] taken as output (penalties, seeds and
        min_tokens see them), then each chunk keeps the tokens up to its first draft that differs
        from the draw at its position. Returns the drawn tokens [R] and each chunk's number of
        new tokens [C] (leading matches + 1) on the device, and the logprobs function (per row)."""
        reqs, index, prior, drafts, row_chunk, row_j = [], [], [], [], [], []
        for i, (c, base) in enumerate(zip(chunks, out_index)):
            d = c.draft_token_ids
            for j in range(len(d) + 1):
                reqs.append(c.request)
                index.append(base + j)
                prior.append(d[:j])
                drafts.append(d[j] if j < len(d) else -1)
                row_chunk.append(i)
                row_j.append(j)
        R, C = len(reqs), len(chunks)
        tokens, lps, pen = self._sample(logits, reqs, index, prior)
        # [C, K + 1] row numbers of each chunk's rows, padded with R: a sentinel that never matches.
        K1 = max(row_j) + 1
        pos = np.full((C, K1), R, dtype=np.int64)
        pos[row_chunk, row_j] = np.arange(R)
        host = np.concatenate([np.asarray(drafts, np.int64), pos.reshape(-1), row_chunk, row_j])
        dev = torch.from_numpy(host).to(self.device, non_blocking=True)
        d_dev, pos_dev = dev[:R], dev[R : R + C * K1].view(C, K1)
        rc_dev, rj_dev = dev[R + C * K1 : 2 * R + C * K1], dev[2 * R + C * K1 :]
        match = torch.cat([tokens == d_dev, tokens.new_zeros(1, dtype=torch.bool)])
        num_new = match[pos_dev].int().cumprod(dim=1).sum(dim=1) + 1
        if pen is not None:  # count the tokens kept (the rows up to each chunk's first mismatch)
            kept = (rj_dev < num_new[rc_dev]).int()
            self.penalties.counts.index_put_((pen[1], tokens[pen[0]]), kept[pen[0]], accumulate=True)
        return tokens, num_new, lps

    def _sample(
        self, logits: torch.Tensor, reqs: list[Request], out_index: list[int], prior: list[list[int]] | None
    ) -> tuple[torch.Tensor, object, tuple[torch.Tensor, torch.Tensor] | None]:
        """Tokens, the logprobs function, and (penalised row numbers, their penalty-state rows) or None.
        prior[i]: tokens taken as output before row i (drafts), counted by its penalties."""
        params = [r.params for r in reqs]
        pen = [
            i for i, p in enumerate(params) if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
        ]
        ban = [i for i, r in enumerate(reqs) if out_index[i] < r.params.min_tokens and r.eos_token_ids]
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        if biased:  # first, on the raw logits (OpenAI / vLLM): penalties, bans and cuts see the biased ones
            self._apply_bias(logits, biased, reqs)
        pen_rows = None
        if pen:
            pen_prior = [prior[i] for i in pen] if prior is not None else None
            pen_rows = self._apply_penalties(logits, pen, [reqs[i] for i in pen], pen_prior)
        if ban:
            rows = [i for i in ban for _ in reqs[i].eos_token_ids]
            toks = [t for i in ban for t in reqs[i].eos_token_ids]
            idx = torch.tensor([rows, toks], dtype=torch.int64).to(self.device, non_blocking=True)
            keep = idx[1] < self.vocab
            logits[idx[0][keep], idx[1][keep]] = float("-inf")
        # Logprobs of the biased, penalised, banned logits before temperature (as the host sampler).
        lps = self._logprobs(logits, want_lp, reqs) if want_lp else None
        if all(p.greedy for p in params):
            tokens = logits.argmax(dim=1)
        else:
            tokens = self._draw(logits, reqs, out_index)
        if pen_rows is None:
            return tokens, lps, None
        return tokens, lps, (torch.tensor(pen, dtype=torch.int64, device=self.device), pen_rows)

    def _bias_block(self, req: Request) -> np.ndarray:
        cached = self._bias.get(req.req_id)
        # The identity check keeps a reused request id from inheriting a stale bias.
        if cached is None or cached[0] is not req.params.logit_bias:
            ids, vals = bias_arrays(req.params.logit_bias, self.vocab)
            cached = self._bias[req.req_id] = (req.params.logit_bias, np.stack([ids, vals]).astype(np.float64))
        return cached[1]

    def _apply_bias(self, logits: torch.Tensor, idx: list[int], reqs: list[Request]) -> None:
        """logits[i, t] += bias for each (t, bias) of each reqs[i], i in idx: one upload, one scatter-add."""
        blocks = [self._bias_block(reqs[i]) for i in idx]
        rows = np.repeat(np.asarray(idx, dtype=np.float64), [b.shape[1] for b in blocks])
        # One float64 block (row, id, bias): ids and rows are exact in float64, biases are float32 below.
        dev = torch.from_numpy(np.vstack([rows[None], np.concatenate(blocks, axis=1)]))
        dev = dev.to(self.device, non_blocking=True)
        logits.index_put_((dev[0].long(), dev[1].long()), dev[2].to(logits.dtype), accumulate=True)

    def _apply_penalties(
        self, logits: torch.Tensor, idx: list[int], reqs: list[Request], prior: list[list[int]] | None = None
    ) -> torch.Tensor:
        rows = self.penalties.rows(reqs)
        p = torch.tensor(
            [[r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty] for r in reqs],
            dtype=torch.float32,
        ).to(self.device, non_blocking=True)
        b = torch.tensor(idx, dtype=torch.int64).to(self.device, non_blocking=True)
        x = logits[b]
        counts = self.penalties.counts[rows]
        if prior is not None and any(prior):  # drafts before each row count as its output
            at = torch.tensor([[q, t] for q, ts in enumerate(prior) for t in ts], dtype=torch.int64).to(
                self.device, non_blocking=True
            )
            counts.index_put_((at[:, 0], at[:, 1]), torch.ones_like(at[:, 0], dtype=counts.dtype), accumulate=True)
        rep = p[:, 0:1]
        seen = self.penalties.seen[rows] | (counts > 0)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - p[:, 1:2] * counts - p[:, 2:3] * (counts > 0)
        logits[b] = x
        return rows

    def _logprobs(self, logits: torch.Tensor, idx: list[int], reqs: list[Request]):
        k = max(reqs[i].params.logprobs for i in idx)
        b = torch.tensor(idx, dtype=torch.int64, device=self.device)
        ls = torch.log_softmax(logits[b], dim=-1)
        top_v, top_i = ls.topk(max(k, 1), dim=-1)

        def finish(tokens: torch.Tensor) -> list[TokenLogprobs | None]:
            chosen = ls.gather(1, tokens[b][:, None])[:, 0]
            cv, tv, ti = chosen.tolist(), top_v.tolist(), top_i.tolist()
            out: list[TokenLogprobs | None] = [None] * len(reqs)
            for j, i in enumerate(idx):
                kk = reqs[i].params.logprobs
                out[i] = TokenLogprobs(cv[j], list(zip(ti[j][:kk], tv[j][:kk])))
            return out

        return finish

    def _draw(self, logits: torch.Tensor, reqs: list[Request], out_index: list[int]) -> torch.Tensor:
        n = len(reqs)
        prm = np.empty((4, n), dtype=np.float64)
        for i, r in enumerate(reqs):
            p = r.params
            prm[0, i] = 0.0 if p.greedy else 1.0 / p.temperature
            prm[1, i] = mix_key(self._seed(r), out_index[i]) if not p.greedy else 0
            prm[2, i] = p.top_k if (p.top_k and not p.greedy) else 0
            prm[3, i] = p.top_p if not p.greedy else 1.0
        dev = torch.from_numpy(prm).to(self.device, non_blocking=True)
        inv_temp = dev[0].float()
        keys = dev[1].long()
        if (prm[2] > 0).any() or (prm[3] < 1.0).any():
            logits = self._filter(logits, inv_temp, dev[2].long(), dev[3].float())
            inv_temp = torch.where(inv_temp > 0, 1.0, 0.0)
        return gumbel_argmax(logits, inv_temp, keys)

    @staticmethod
    def _filter(logits: torch.Tensor, inv_temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Scale sampled rows by their temperature and mask all but their top-k / nucleus (greedy rows untouched)."""
        scaled = torch.where(inv_temp[:, None] > 0, logits * inv_temp[:, None], logits)
        vals, order = scaled.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vals.shape[1], device=vals.device)[None, :]
        k = torch.where(top_k > 0, top_k, vals.shape[1])
        vals = vals.masked_fill(rank >= k[:, None], float("-inf"))
        probs = vals.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs
        drop = (before >= top_p[:, None]) & (rank > 0) & (top_p[:, None] < 1.0)
        vals = vals.masked_fill(drop & (inv_temp[:, None] > 0), float("-inf"))
        return scaled.scatter(1, order, vals)
