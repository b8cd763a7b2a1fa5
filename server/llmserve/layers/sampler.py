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
The algorithm, its keys and seeds are engine/draw.py's, which the host sampler
runs in numpy: both draw the same tokens from the same logits, seed and output
index, but for the log / exp rounding that engine/draw.py describes.

Per step the host uploads one small parameter block; penalty counts live on
the device per request and are updated with each request's new tokens, so a
penalised request costs O(new tokens) host work per step, not O(length).

Verification (speculative decoding, `verify`; the contract is in engine/runner_contract.py). Row j of a
chunk with k drafts is processed as without speculation with drafts[:j] taken as output. Then:
- drafts without a distribution (n-gram proposals; every greedy request): the coupled one-hot path,
  keep draft j while the target's own draw at row j equals it;
- drafts of a sampled request that carry their proposal distribution q (`Request.draft_probs`,
  [k, V], set by a draft model, runners/torch/draft.py): standard rejection sampling. With p_j the
  target's distribution at row j (bias, penalties, min_tokens ban, temperature, top-k, top-p:
  exactly what a draw without speculation samples from), draft d_j is kept when
  u_j * q_j(d_j) < p_j(d_j), u_j a uniform hashed from the row's (seed, output index) key on the
  device (`_uniform`); at the first rejection the row draws from norm(max(0, p_j - q_j)) by
  Gumbel-max with that key; a bonus row (all kept) draws from p as without speculation. The
  output has the target's distribution whatever q is. A draft model draws its proposals from q
  with keys salted away from the target's (`propose`, DRAFT_STREAM), so d_j is independent of u_j
  and of the residual draw.
No step of it waits for the device.
"""

from __future__ import annotations

import numpy as np
import torch

from llmserve.engine.draw import DRAFT_STREAM, RequestSeeds, mix_key
from llmserve.engine.request import Request
from llmserve.engine.runner_contract import SeqChunk, TokenLogprobs
from llmserve.engine.sampler import bias_arrays
from llmserve.kernels.sampling import M32, argmax, gumbel_argmax
from llmserve.layers.penalties import PenaltyState


def _uniform(keys: torch.Tensor) -> torch.Tensor:
    """[N] int64 32-bit row keys -> [N] float32 uniforms in (0, 1): the acceptance tests of rejection
    sampling. A counter-based hash (murmur3's finaliser on the key with a salt), independent of
    the Gumbel noise that the same key gives each token (kernels/sampling.py)."""
    x = (keys ^ 0x5851F42D) & M32
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & M32
    x = x ^ (x >> 16)
    return ((x >> 9).float() + 0.5) * (1.0 / 8388608.0)  # 23 bits: never exactly 0 or 1 in float32


class DeviceSampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab = vocab_size
        self.device = device
        self.penalties = PenaltyState(vocab_size, device)
        self._seeds = RequestSeeds(seed)  # engine-drawn seeds of requests without their own (engine/draw.py)
        # req_id -> (its logit_bias dict, [2, n] float64 host block of token ids and biases): built
        # once per request, as its bias never changes.
        self._bias: dict[str, tuple[dict[int, float], np.ndarray]] = {}

    def drop(self, req_ids: list[str]) -> None:
        self.penalties.drop(req_ids)
        # Unseeded requests keep their drawn seed across preemption: it is only forgotten
        # when the request is gone (a new request with the same id draws afresh).
        for rid in req_ids:
            self._seeds.drop(rid)
            self._bias.pop(rid, None)

    def _seed(self, req: Request) -> int:
        return self._seeds.of(req.req_id, req.params.seed)

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
        """Sampling chunks with drafts (engine/runner_contract.py): logits [R, V], each chunk's
        `num_sampled_rows` rows in turn; out_index[i]: output index of chunk i's first row.
        Row j is drawn as `sample` draws it with drafts[:j] taken as output (penalties, seeds and
        min_tokens see them), then each chunk keeps the tokens up to its first draft that differs
        from the token at its position. That token is the draw itself (one-hot path), or, for a
        sampled request whose drafts carry their distribution q (`request.draft_probs`, its first
        len(drafts) rows), the outcome of rejection sampling: the draft when kept, else a draw from
        norm(max(0, p - q)) (module doc). Returns the tokens [R] and each chunk's number of new
        tokens [C] (leading matches + 1) on the device, and the logprobs function (per row)."""
        reqs, index, prior, drafts, row_chunk, row_j = [], [], [], [], [], []
        q_rows, q_parts = [], []  # draft rows verified against their q, and those q rows
        for i, (c, base) in enumerate(zip(chunks, out_index)):
            d = c.draft_token_ids
            q = c.request.draft_probs
            if d and q is not None and not c.request.params.greedy:
                q_rows.extend(range(len(reqs), len(reqs) + len(d)))
                q_parts.append(q[: len(d)])
            for j in range(len(d) + 1):
                reqs.append(c.request)
                index.append(base + j)
                prior.append(d[:j])
                drafts.append(d[j] if j < len(d) else -1)
                row_chunk.append(i)
                row_j.append(j)
        R, C = len(reqs), len(chunks)
        tokens, lps, pen = self._sample(logits, reqs, index, prior)
        if q_rows:
            self._reject(logits, tokens, q_rows, q_parts, reqs, index, drafts)
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

    def _reject(
        self,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        rows: list[int],
        q_parts: list[torch.Tensor],
        reqs: list[Request],
        index: list[int],
        drafts: list[int],
    ) -> None:
        """Rejection sampling of draft rows `rows` (their q: `q_parts` concatenated), in place in
        `tokens`: each becomes its draft when kept (u * q(d) < p(d)), else a draw from
        norm(max(0, p - q)) by Gumbel-max with the row's own key. `logits`: processed by `_sample`."""
        sub = [reqs[r] for r in rows]
        prm = self._draw_params(sub, [index[r] for r in rows])  # inv_temp, key, top_k, top_p
        host = np.vstack([prm, np.asarray([rows, [drafts[r] for r in rows]], dtype=np.float64)])
        dev = torch.from_numpy(host).to(self.device, non_blocking=True)
        keys, at, d = dev[1].long(), dev[4].long(), dev[5].long()
        p = self._probs(logits.index_select(0, at), dev[0].float(), dev[2].long(), dev[3].float(), prm)
        q = torch.cat(q_parts) if len(q_parts) > 1 else q_parts[0]
        if q.shape != p.shape:
            raise ValueError(f"draft_probs rows have {q.shape[1]} tokens; the vocabulary has {p.shape[1]}")
        q = q.to(p.dtype)
        keep = _uniform(keys) * q.gather(1, d[:, None])[:, 0] < p.gather(1, d[:, None])[:, 0]
        res = (p - q).clamp_min_(0.0)
        # Rejected only when p(d) < q(d), so the residual has mass; if rounding left none, p itself.
        res = torch.where(res.sum(dim=1, keepdim=True) > 0, res, p)
        fix = gumbel_argmax(res.log(), torch.ones_like(keys, dtype=torch.float32), keys)
        tokens.index_copy_(0, at, torch.where(keep, d, fix))

    def propose(
        self, logits: torch.Tensor, reqs: list[Request], out_index: list[int], prior: list[list[int]] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft model's proposals (runners/torch/draft.py): logits [N, V] (modified in place) are
        processed as `_sample` processes them (prior[i]: the proposals before row i, counted by its
        penalties); greedy rows take the argmax, sampled rows draw from q, their temperature / top-k /
        top-p distribution, with keys salted by DRAFT_STREAM. Returns the tokens [N] and q [N, V] (its
        rows of greedy requests mean nothing; None when all are greedy), on the device. Counts no
        penalty tokens: the caller keeps the counts at the accepted output."""
        self._process(logits, reqs, out_index, prior)
        best = argmax(logits)
        if all(r.params.greedy for r in reqs):
            return best, None
        prm = self._draw_params(reqs, out_index, DRAFT_STREAM)
        dev = torch.from_numpy(prm).to(self.device, non_blocking=True)
        inv_temp = dev[0].float()
        q = self._probs(logits, inv_temp, dev[2].long(), dev[3].float(), prm)
        drawn = gumbel_argmax(q.log(), torch.ones_like(inv_temp), dev[1].long())
        return torch.where(inv_temp > 0, drawn, best), q

    def _sample(
        self, logits: torch.Tensor, reqs: list[Request], out_index: list[int], prior: list[list[int]] | None
    ) -> tuple[torch.Tensor, object, tuple[torch.Tensor, torch.Tensor] | None]:
        """Tokens, the logprobs function, and (penalised row numbers, their penalty-state rows) or None.
        prior[i]: tokens taken as output before row i (drafts), counted by its penalties."""
        params = [r.params for r in reqs]
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        pen = self._process(logits, reqs, out_index, prior)
        # Logprobs of the biased, penalised, banned logits before temperature (as the host sampler).
        lps = self._logprobs(logits, want_lp, reqs) if want_lp else None
        if all(p.greedy for p in params):
            tokens = argmax(logits)
        else:
            tokens = self._draw(logits, reqs, out_index)
        return tokens, lps, pen

    def _process(
        self, logits: torch.Tensor, reqs: list[Request], out_index: list[int], prior: list[list[int]] | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """In place: logit bias, penalties (prior[i]: drafts counted as output), the min_tokens ban.
        Returns (penalised row numbers, their penalty-state rows), or None when no row is penalised."""
        params = [r.params for r in reqs]
        pen = [i for i, p in enumerate(params) if p.penalised]
        ban = [i for i, r in enumerate(reqs) if out_index[i] < r.params.min_tokens and r.eos_token_ids]
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
        if pen_rows is None:
            return None
        return torch.tensor(pen, dtype=torch.int64).to(self.device, non_blocking=True), pen_rows

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
            [[r.params.repetition, r.params.frequency_penalty, r.params.presence_penalty] for r in reqs],
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
        b = torch.tensor(idx, dtype=torch.int64).to(self.device, non_blocking=True)
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

    def _draw_params(self, reqs: list[Request], out_index: list[int], salt: int = 0) -> np.ndarray:
        """[4, N] float64 host block: inverse temperature (0: greedy), the draw's key (from the seed
        xor `salt` and the output index), top_k (0: off), top_p."""
        prm = np.empty((4, len(reqs)), dtype=np.float64)
        for i, r in enumerate(reqs):
            p = r.params
            prm[0, i] = 0.0 if p.greedy else 1.0 / p.temperature
            prm[1, i] = mix_key(self._seed(r) ^ salt, out_index[i]) if not p.greedy else 0
            prm[2, i] = p.top_k if (p.top_k and not p.greedy) else 0
            prm[3, i] = p.top_p if not p.greedy else 1.0
        return prm

    def _draw(self, logits: torch.Tensor, reqs: list[Request], out_index: list[int]) -> torch.Tensor:
        prm = self._draw_params(reqs, out_index)
        dev = torch.from_numpy(prm).to(self.device, non_blocking=True)
        inv_temp = dev[0].float()
        keys = dev[1].long()
        if (prm[2] > 0).any() or (prm[3] < 1.0).any():
            logits = self._filter(logits, inv_temp, dev[2].long(), dev[3].float())
            inv_temp = torch.where(inv_temp > 0, 1.0, 0.0)
        return gumbel_argmax(logits, inv_temp, keys)

    def _probs(
        self, logits: torch.Tensor, inv_temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, prm: np.ndarray
    ) -> torch.Tensor:
        """[N, V] float32: the distribution `_draw` samples each sampled row from (the softmax of its
        temperature-scaled logits cut to top-k / the nucleus); greedy rows: softmax of the logits.
        prm: the host block of `_draw_params`, to skip the sort when no row cuts."""
        if (prm[2] > 0).any() or (prm[3] < 1.0).any():
            x = self._filter(logits, inv_temp, top_k, top_p)
        else:
            x = torch.where(inv_temp[:, None] > 0, logits * inv_temp[:, None], logits)
        return x.softmax(dim=-1)

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
