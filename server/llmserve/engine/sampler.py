"""Host-side sampler (numpy): logit bias, penalties, min length, temperature, top-k, top-p, seeds.

Used by runners whose logits come back to the host (the Paddle runner). It runs the algorithm of
engine/draw.py, as the torch runner's device sampler (layers/sampler.py) does, with the same float32
operations in the same order (bias, penalties, ban, scaling by float32(1 / temperature), cuts,
Gumbel-max over the counter-based noise keyed by (seed, output index)): for the same logits, seed,
request and position both draw the same token, except where log / exp rounding differs (engine/draw.py
says where). No request has a generator: a draw is a function of its key, so a seeded request gives the
same tokens whatever else is in the batch, after preemption, and with or without speculation.
"""

from __future__ import annotations

import numpy as np

from llmserve.engine.draw import RequestSeeds, draw, inverse_temperature, mix_key
from llmserve.engine.request import Request
from llmserve.engine.runner_contract import SeqChunk, TokenLogprobs
from llmserve.engine.sampling_params import SamplingParams
from llmserve.engine.structured import allowed_tokens


def bias_arrays(bias: dict[int, float], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """OpenAI logit_bias as (token ids int64, biases float32), ids past the vocabulary dropped
    (SamplingParams cannot know the vocabulary; such a token can never be drawn anyway)."""
    items = [(t, b) for t, b in bias.items() if t < vocab]
    ids = np.fromiter((t for t, _ in items), dtype=np.int64, count=len(items))
    vals = np.fromiter((b for _, b in items), dtype=np.float32, count=len(items))
    return ids, vals


def apply_penalties(
    logits: np.ndarray, prompt_ids: list[int], output_ids: list[int], params: SamplingParams
) -> np.ndarray:
    """Penalise one row of logits in place and return it.

    repetition_penalty (penalty_score) applies to every token seen in the prompt
    or the output: positive logits are divided by it, negative ones multiplied.
    frequency/presence penalties apply to output tokens: logit -= f * count + p * (count > 0).
    In float32, rounded as the device sampler rounds: (logit - f * count) - p.
    """
    if params.repetition != 1.0:
        rep = np.float32(params.repetition)
        seen = np.unique(np.asarray(prompt_ids + output_ids, dtype=np.int64))
        vals = logits[seen]
        logits[seen] = np.where(vals > 0, vals / rep, vals * rep)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        ids, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
        freq = np.float32(params.frequency_penalty) * counts.astype(np.float32)
        logits[ids] = (logits[ids] - freq) - np.float32(params.presence_penalty)
    return logits


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    z = x - m
    return z - np.log(np.exp(z).sum())


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._seeds = RequestSeeds(seed)
        # req_id -> (its logit_bias dict, that dict as arrays): the bias is fixed for a request's life
        self._bias: dict[str, tuple[dict[int, float], np.ndarray, np.ndarray]] = {}

    def drop(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            self._seeds.drop(rid)
            self._bias.pop(rid, None)

    def _bias_of(self, req: Request, vocab: int) -> tuple[np.ndarray, np.ndarray]:
        cached = self._bias.get(req.req_id)
        # The identity check keeps a reused request id from inheriting a stale bias.
        if cached is None or cached[0] is not req.params.logit_bias:
            cached = self._bias[req.req_id] = (req.params.logit_bias, *bias_arrays(req.params.logit_bias, vocab))
        return cached[1], cached[2]

    def sample(
        self, logits: np.ndarray, requests: list[Request]
    ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        tokens: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        want_logprobs = False
        for row, req in zip(logits, requests):
            token, lp = self.sample_one(np.array(row, dtype=np.float32), req)
            tokens.append(token)
            logprobs.append(lp)
            want_logprobs |= lp is not None
        return tokens, (logprobs if want_logprobs else None)

    def sample_chunks(
        self, logits: np.ndarray, chunks: list[SeqChunk]
    ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None] | None]:
        """Tokens of sampling chunks from their rows of logits (`num_sampled_rows` each, in order),
        verifying drafts as engine/runner_contract.py says: row j is sampled as if drafts[:j] were output (its key
        is that of output index len(output) + j), and the rows after the first mismatch are not drawn;
        a seeded request draws the tokens it draws without speculation."""
        tokens: list[list[int]] = []
        logprobs: list[list[TokenLogprobs] | None] = []
        r = 0
        for c in chunks:
            req, drafts = c.request, c.draft_token_ids
            toks, lps = [], []
            for j in range(len(drafts) + 1):
                row = np.array(logits[r + j], dtype=np.float32)
                if c.token_bitmask is not None:  # structured output: only what the grammar allows
                    row[~allowed_tokens(c.bitmask()[j], row.shape[0])] = -np.inf
                t, lp = self.sample_one(row, req, drafts[:j])
                toks.append(t)
                lps.append(lp)
                if j == len(drafts) or t != drafts[j]:
                    break
            r += len(drafts) + 1
            tokens.append(toks)
            logprobs.append(lps if req.params.logprobs is not None else None)
        want = any(lp is not None for lp in logprobs)
        return tokens, (logprobs if want else None)

    def sample_one(self, row: np.ndarray, req: Request, drafts: list[int] = ()) -> tuple[int, TokenLogprobs | None]:
        """One token for `req` from its row; `drafts`: proposed tokens taken as already output."""
        p = req.params
        if p.logit_bias:
            # Added to the raw logits first, as OpenAI and vLLM do: the penalties, the min_tokens ban,
            # greedy's argmax, temperature and the top-k/top-p cuts all see the biased logits.
            ids, vals = self._bias_of(req, row.shape[0])
            row[ids] += vals  # ids are unique (dict keys), so no accumulation is needed
        output = req.output_token_ids + list(drafts) if drafts else req.output_token_ids
        apply_penalties(row, req.prompt_token_ids, output, p)
        if len(output) < p.min_tokens:
            banned = [t for t in req.eos_token_ids if 0 <= t < row.shape[0]]
            row[banned] = -np.inf
        if p.greedy:
            token = int(np.argmax(row))
        else:
            key = mix_key(self._seeds.of(req.req_id, p.seed), len(output))
            token = draw(row * inverse_temperature(p.temperature), key, p.top_k, p.top_p)
        lp = None
        if p.logprobs is not None:
            # Logprobs of the processed logits before temperature: the bias shows in them, as the
            # penalties and the min_tokens ban do (vLLM V1 by default reports logprobs of the raw logits, without it).
            ls = log_softmax(row)
            top = np.argsort(-ls, kind="stable")[: p.logprobs]
            lp = TokenLogprobs(float(ls[token]), [(int(t), float(ls[t])) for t in top])
        return token, lp
