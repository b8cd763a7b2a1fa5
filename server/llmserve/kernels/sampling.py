"""Sampling by the Gumbel-max trick with counter-based noise.

token = argmax(logits * inv_temp + gumbel(u)), u = hash(key, token id): each
row's `key` comes from its request's seed and output index, so a seeded
request draws the same token whatever batch it runs in, and no per-request
generator (nor host sync) is needed. Rows with `inv_temp == 0` mean greedy:
plain argmax, no noise. The hash is 32-bit integer mixing done in int64 so
that the torch reference and the kernel produce the same bits.

The algorithm is engine/draw.py's (its keys `mix_key`, its numpy form of the same noise, run by the
host sampler); kernels may not import the engine, so the hash constants and MIN_EXP are repeated here,
and tests/test_sampler_parity.py checks that both give the same uniforms bit for bit. The logs of the
noise are float32 and rounded as each library rounds them (the kernel's is the GPU's fast log).
"""

from __future__ import annotations

import torch

from llmserve.kernels import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

M32 = 0xFFFFFFFF
# -log(1 - 2**-24), the smallest exponential the noise gives: a floor for it keeps the Gumbel noise
# finite (<= 16.7) should a fast approximate log round -log(u) to 0 (or below) for u near 1.
MIN_EXP = 5.9604645e-08


def _noise_ref(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N] int64 keys -> [N, V] float32 uniforms in [2**-24, 1 - 2**-24], never 0 or 1."""
    x = torch.arange(vocab, dtype=torch.int64, device=keys.device)[None, :]
    x = ((x * 0x27D4EB2D) & M32) ^ keys[:, None]
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & M32
    x = x ^ (x >> 16)
    # 23 bits, not 24: (2**24 - 1) + 0.5 rounds to 2**24 in float32, so u could be exactly 1, its
    # Gumbel noise +inf, and that token drawn whatever its logit (NaN, still argmax's pick, if masked).
    return ((x >> 9).float() + 0.5) * (1.0 / 8388608.0)


def gumbel_argmax_ref(logits: torch.Tensor, inv_temp: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    u = _noise_ref(keys, logits.shape[1])
    g = -torch.log((-torch.log(u)).clamp_min(MIN_EXP))
    noisy = inv_temp[:, None] > 0
    scores = torch.where(noisy, logits * inv_temp[:, None] + g, logits)
    return scores.argmax(dim=1)


if triton is not None:

    @triton.jit
    def _gumbel_argmax_kernel(logits_ptr, inv_temp_ptr, keys_ptr, out_ptr, stride, vocab, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        it = tl.load(inv_temp_ptr + row)
        key = tl.load(keys_ptr + row)
        noisy = it > 0.0
        best_v = tl.full([], float("-inf"), tl.float32)
        best_i = tl.full([], 0, tl.int32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            m = cols < vocab
            x = tl.load(logits_ptr + row * stride + cols, mask=m, other=float("-inf"))
            if noisy:
                h = ((cols.to(tl.int64) * 0x27D4EB2D) & 0xFFFFFFFF) ^ key
                h = h ^ (h >> 16)
                h = (h * 0x45D9F3B) & 0xFFFFFFFF
                h = h ^ (h >> 16)
                h = (h * 0x45D9F3B) & 0xFFFFFFFF
                h = h ^ (h >> 16)
                u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # in (0, 1): see _noise_ref
                x = x * it - tl.log(tl.maximum(-tl.log(u), 5.9604645e-08))  # MIN_EXP (a literal: jit)
                x = tl.where(m, x, float("-inf"))
            v = tl.max(x, axis=0)
            i = tl.argmax(x, axis=0) + start
            better = v > best_v
            best_i = tl.where(better, i, best_i)
            best_v = tl.where(better, v, best_v)
        tl.store(out_ptr + row, best_i)


def gumbel_argmax(logits: torch.Tensor, inv_temp: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """logits [N, V] float32, inv_temp [N] float32 (0: greedy), keys [N] int64 -> [N] int64 token ids."""
    if not use_triton(logits):
        return gumbel_argmax_ref(logits, inv_temp, keys)
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(logits.shape[0],)](
        logits, inv_temp, keys, out, logits.stride(0), logits.shape[1], BLOCK=4096, num_warps=8
    )
    return out


if triton is not None:

    @triton.jit
    def _argmax_part_kernel(x_ptr, part_ptr, stride, vocab, parts, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """The best (value, first index) of one chunk of a row, as one int64 key: the float's bits made ordered
        as an int (NaN above everything, as torch's argmax takes it) over M32 - index (a lower index wins ties)."""
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        best = tl.full([BLOCK], -(2**63), tl.int64)
        for start in range(part * CHUNK, part * CHUNK + CHUNK, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            m = cols < vocab
            x = tl.load(x_ptr + row * stride + cols, mask=m, other=float("-inf")).to(tl.float32)
            bits = x.to(tl.int32, bitcast=True)
            ordered = tl.where(x != x, 0x7FFFFFFF, bits ^ ((bits >> 31) & 0x7FFFFFFF))
            key = (ordered.to(tl.int64) << 32) + (0xFFFFFFFF - cols.to(tl.int64))
            best = tl.maximum(best, tl.where(m, key, -(2**63)))
        tl.store(part_ptr + row * parts + part, tl.max(best, axis=0))

    @triton.jit
    def _argmax_join_kernel(part_ptr, out_ptr, parts, P_PAD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        p = tl.arange(0, P_PAD)
        key = tl.max(tl.load(part_ptr + row * parts + p, mask=p < parts, other=-(2**63)), axis=0)
        tl.store(out_ptr + row, 0xFFFFFFFF - (key & 0xFFFFFFFF))


ARGMAX_BLOCK = 1024
ARGMAX_PARTS = 64  # a row's chunks, one program each


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> [N] int64: torch.argmax(dim=1)'s indices (the first of equal maxima; a NaN wins), each row
    split over up to ARGMAX_PARTS programs, then joined: 2.0 + 1.3 us for one 128K row on an H100, where torch's
    took 38.5 (run 130)."""
    if not use_triton(logits):
        return logits.argmax(dim=1)
    rows, vocab = logits.shape
    parts = min(ARGMAX_PARTS, triton.cdiv(vocab, ARGMAX_BLOCK))
    chunk = triton.cdiv(triton.cdiv(vocab, parts), ARGMAX_BLOCK) * ARGMAX_BLOCK
    part = torch.empty(rows, parts, dtype=torch.int64, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _argmax_part_kernel[(rows, parts)](
            logits, part, logits.stride(0), vocab, parts, CHUNK=chunk, BLOCK=ARGMAX_BLOCK, num_warps=4
        )
        _argmax_join_kernel[(rows,)](part, out, parts, P_PAD=max(2, triton.next_power_of_2(parts)), num_warps=1)
    return out
