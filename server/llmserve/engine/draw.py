"""The one sampling algorithm of both runners: per-request keys, counter-based noise, Gumbel-max, the cuts.

A sampled row (after logit bias, penalties and the min_tokens ban) draws

    token = argmax over the kept tokens t of  logits[t] * float32(1 / temperature) + g(u(key, t))

- key = mix_key(seed, output index): `seed` is the request's own, or one the sampler draws for it
  (`RequestSeeds`); the output index counts the tokens before this one (drafts taken as output
  included). Nothing else keys a draw, so a seeded request draws the same token in any batch, after
  preemption, and with or without speculation.
- u(key, t): a 32-bit integer hash of (key, token id) made a float32 in (0, 1) from 23 bits;
  g(u) = -log(max(-log u, MIN_EXP)), Gumbel noise (float32).
- kept tokens: all, or the top_k best (stable descending order: ties keep the lower id), then the
  nucleus among those: a token is dropped when the float32 mass of the tokens before it in that order
  (softmax of the top-k-cut scaled logits; prefix sums in float64, as torch sums on the CPU) is
  >= float32(top_p), the first token always kept. Ties of the noisy score go to the lower token id.

This module is its numpy form (the host sampler, engine/sampler.py). The device sampler
(layers/sampler.py) runs the same definitions in torch: the noise in kernels/sampling.py (its torch
reference `_noise_ref` and the Triton kernel), the cuts in `DeviceSampler._filter`; it takes its keys
and seeds from here. The integer hashing is exact in both, so u is bit for bit the same
(tests/test_sampler_parity.py). The one remaining difference: log and exp are rounded differently by
numpy, torch on the CPU and the GPU's fast log (about a third of the float32 noise values differ in
the last bit between numpy and torch), so the two runners draw different tokens only where two
tokens' noisy scores, or top_p and a nucleus prefix mass, lie within float32 rounding of each other.
"""

from __future__ import annotations

import random

import numpy as np

M32 = 0xFFFFFFFF
M64 = 0xFFFFFFFFFFFFFFFF
# -log(1 - 2**-24), the smallest exponential the noise gives: a floor for it keeps the Gumbel noise
# finite (<= 16.7) should a fast approximate log round -log(u) to 0 (or below) for u near 1.
MIN_EXP = 5.9604645e-08
# Salts the seeds of a draft model's draws (DeviceSampler.propose) away from the target's: the draft's
# proposals must be independent of the target's acceptance uniforms and residual draws at the same index.
DRAFT_STREAM = 0x6A09E667F3BCC908
# The token-id hash of u(key, t): kernels/sampling.py repeats these constants (it may not import the engine).
TOKEN_MUL, MIX_MUL = 0x27D4EB2D, 0x45D9F3B


def mix_key(seed: int, index: int) -> int:
    """32-bit key of (request seed, output index): splitmix64-style mixing, host side."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & M64
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 29
    return x & M32


def uniforms(key: int, ids: np.ndarray) -> np.ndarray:
    """u(key, t) for token ids `ids` (int64): float32 in [2**-24, 1 - 2**-24], never 0 or 1.
    int64 arithmetic: every product stays under 2**63, so the bits are those of the torch reference."""
    x = ((ids.astype(np.int64, copy=False) * TOKEN_MUL) & M32) ^ key
    x ^= x >> 16
    x = (x * MIX_MUL) & M32
    x ^= x >> 16
    x = (x * MIX_MUL) & M32
    x ^= x >> 16
    # 23 bits, not 24: (2**24 - 1) + 0.5 rounds to 2**24 in float32, so u could be exactly 1.
    return ((x >> 9).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 8388608.0)


def gumbel(u: np.ndarray) -> np.ndarray:
    """Gumbel noise of uniforms, float32 (the operations of kernels/sampling.py's reference)."""
    return -np.log(np.maximum(-np.log(u), np.float32(MIN_EXP)))


def inverse_temperature(temperature: float) -> np.float32:
    """What a sampled row's logits are multiplied by: 1 / temperature rounded once to float32 (the
    device sampler uploads it so); dividing by the temperature would round differently."""
    return np.float32(1.0 / temperature)


def best(scaled: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k best of `scaled`, in stable descending order (equal values: the lower id first),
    with a partial sort of the row: what a stable descending sort's first k are."""
    V = scaled.shape[0]
    if k >= V:
        return np.argsort(-scaled, kind="stable")
    kth = np.partition(scaled, V - k)[V - k]
    above = np.flatnonzero(scaled > kth)
    cand = np.concatenate([above, np.flatnonzero(scaled == kth)[: k - len(above)]])
    return cand[np.lexsort((cand, -scaled[cand]))]


def kept(scaled: np.ndarray, top_k: int, top_p: float) -> np.ndarray | None:
    """Token ids that the top-k and nucleus cuts keep of temperature-scaled float32 logits (in descending
    order of their logits); None when neither cuts (every token is kept)."""
    V = scaled.shape[0]
    k = top_k if 0 < top_k < V else V
    if k == V and top_p >= 1.0:
        return None
    if top_p >= 1.0:
        return best(scaled, k)
    top = np.float32(top_p)
    if k < V:  # the softmax of what top-k kept
        order = best(scaled, k)
        e = np.exp(scaled[order] - scaled[order[0]])
        inv = np.float32(1.0) / e.sum(dtype=np.float32)
    else:  # the softmax of the whole row, but sorted only as far as the nucleus reaches
        e_all = np.exp(scaled - scaled.max())
        inv = np.float32(1.0) / e_all.sum(dtype=np.float32)
        m = min(V, 1024)
        while True:
            order = best(scaled, m)
            e = e_all[order]
            if m == V:
                break
            last = np.cumsum(e * inv, dtype=np.float64)[-1].astype(np.float32) - e[-1] * inv
            if last >= top:  # the prefix's last token is dropped, so is every one after it
                break
            m = min(V, 4 * m)
    probs = e * inv
    before = np.cumsum(probs, dtype=np.float64).astype(np.float32) - probs
    keep = before < top
    keep[0] = True
    return order[keep]


def draw(scaled: np.ndarray, key: int, top_k: int = 0, top_p: float = 1.0) -> int:
    """The token of one sampled row: Gumbel-max over the kept tokens of its scaled float32 logits."""
    ids = kept(scaled, top_k, top_p)
    if ids is None:
        scores = scaled + gumbel(uniforms(key, np.arange(scaled.shape[0])))
        return int(np.argmax(scores))
    scores = scaled[ids] + gumbel(uniforms(key, ids))
    return int(ids[scores == scores.max()].min())  # equal scores: the lower id, as an argmax over the row


class RequestSeeds:
    """Each request's seed: its own, or one drawn for it from the sampler's generator the first time it
    samples, kept until the request is dropped (so preemption does not change its stream)."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._drawn: dict[str, int] = {}

    def of(self, req_id: str, seed: int | None) -> int:
        if seed is not None:
            return seed
        s = self._drawn.get(req_id)
        if s is None:
            s = self._drawn[req_id] = self._rng.getrandbits(63)
        return s

    def drop(self, req_id: str) -> None:
        self._drawn.pop(req_id, None)
