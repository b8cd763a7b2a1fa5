"""Tensor parallelism of the decoder (Megatron style): which rows and columns each rank holds.

Rank r of N holds heads [r*H/N, (r+1)*H/N) of q, the KV heads they read (KV heads are split when
KVH >= N, replicated when KVH < N: rank r then holds KV head r // (N / KVH)), and 1/N of the MLP's
intermediate features. q/k/v and gate/up are column-parallel (each rank computes its own output
features from the whole input); o and down are row-parallel (each rank multiplies its share of the
inputs, and an all-reduce sums the partial outputs). The embedding and the LM head are split along
the vocabulary: each rank looks up (or scores) its rows, and an all-reduce (an all-gather) joins
them. Every rank ends a layer with the same hidden states, so every rank samples the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmserve.config import ConfigError
from llmserve.kernels.norm import rms_norm
from llmserve.layers.model_config import ModelConfig

if TYPE_CHECKING:
    from llmserve.kernels.sum_norm import Pushed
    from llmserve.layers.linear import Linear
    from llmserve.layers.weights import WeightReader

_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # the new name (torch 2.12+)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None  # torch.distributed ProcessGroup (None: the default group)
    # Sums of at most `one_shot_bytes` (decode steps) through `one_shot` (OneShotAllReduce), else NCCL.
    one_shot: object = None
    one_shot_bytes: int = 0
    # Sums followed by an RMSNorm, of at most its bytes, through one kernel (kernels/sum_norm.py).
    fused_norm: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (nothing to do on one rank)."""
        if self.size == 1:
            return x
        if self.one_shot is not None and x.dtype == torch.float32 and x.numel() * 4 <= self.one_shot_bytes:
            return self.one_shot(x)
        dist.all_reduce(x, group=self.group)
        return x

    def row_parallel(self, linear: Linear, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor | Pushed:
        """A row-parallel projection's partial output, for `sum_norm` next. Where the fused sum takes it and
        the product runs on kernels/gemv.py (batch-1 decode), the GEMV writes it straight into every rank's
        buffer of the fused sum and this returns a `Pushed` (kernels/sum_norm.py)."""
        if self.fused_norm is not None and (pushed := self.fused_norm.push(linear, x, out_dtype)) is not None:
            return pushed
        return linear(x, out_dtype)

    def sum_norm(self, x: torch.Tensor | Pushed, w: torch.Tensor, eps: float, residual: torch.Tensor) -> torch.Tensor:
        """RMSNorm of `residual += the ranks' sum of x` (a row-parallel projection's partial output, or the
        `Pushed` that `row_parallel` returned for it)."""
        if self.size > 1:
            if self.fused_norm is not None and self.fused_norm.fits(x, residual):
                return self.fused_norm(x, w, eps, residual)
            x = self.all_reduce(x)
        return rms_norm(x, w, eps, residual)

    def all_gather_cols(self, x: torch.Tensor) -> torch.Tensor:
        """[T, C] per rank -> [T, N*C], rank 0's columns first."""
        if self.size == 1:
            return x
        T, C = x.shape
        out = x.new_empty((self.size * T, C))  # ranks one after another along the rows (gloo's layout too)
        _all_gather(out, x.contiguous(), group=self.group)
        return out.view(self.size, T, C).permute(1, 0, 2).reshape(T, self.size * C)

    def all_min(self, n: int) -> int:
        """The smallest of every rank's `n` (the KV cache every rank has room for)."""
        if self.size == 1:
            return n
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


SINGLE = TensorParallel()

# Up to here a one-shot all-reduce beats NCCL's (H100 x2, 8B shape, a decode step's 65 sums in a CUDA
# graph: 0.57 vs 0.78 ms at batch 1, 1.26 vs 1.29 ms at batch 64; scripts/bench_tp.py).
ONE_SHOT_BYTES = 1 << 20


class OneShotAllReduce:
    """Small sums through torch's symmetric memory: each rank copies its part into a buffer every rank
    can read over NVLink, and one kernel reads all of them (P2P loads; no NVLink multicast). Lower
    latency than NCCL's ring for the few KB of a decode step; ranks of one node only."""

    def __init__(self, group, max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.name = group.group_name
        self.buf = symm_mem.empty(max_bytes, dtype=torch.uint8, device="cuda")
        symm_mem.rendezvous(self.buf, self.name)
        self.ops = torch.ops.symm_mem
        self.copy_out = hasattr(self.ops, "one_shot_all_reduce_copy_out")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x if x.is_contiguous() else x.contiguous()
        b = self.buf[: x.numel() * x.element_size()].view(x.dtype).view_as(x)
        if self.copy_out:
            self.ops.one_shot_all_reduce_copy_out(b, x, "sum", self.name, x)
        else:
            b.copy_(x)
            self.ops.one_shot_all_reduce_out(b, "sum", self.name, x)
        return x


_one_shot_taken = False  # this process has set up symmetric memory for a group already


def with_one_shot(tp: TensorParallel, fused_norm: bool = True, push: bool = True) -> TensorParallel:
    """`tp` with the one-shot all-reduce for small sums, or as it is where this torch or GPU has none,
    and with `fused_norm` the fused sum + RMSNorm too (with_fused_norm; `push`: its GEMVs push).
    Checked once on fresh data: its sum must be NCCL's, and bit-identical on every rank (each rank sums
    for itself, and the ranks must sample the same tokens from the same logits)."""
    global _one_shot_taken
    # Symmetric memory serves one group per process (a second one's rendezvous waits for ever): every
    # rank must be able to try, or none tries.
    can = torch.tensor([int(not _one_shot_taken)], device="cuda")
    dist.all_reduce(can, op=dist.ReduceOp.MIN, group=tp.group)
    if not can.item():
        return tp
    _one_shot_taken = True
    x = torch.randn(8, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(tp.rank))
    want = x.clone()
    dist.all_reduce(want, group=tp.group)
    got = torch.full_like(x, float("nan"))
    try:
        one_shot = OneShotAllReduce(tp.group, ONE_SHOT_BYTES)
        got = one_shot(x)
    except Exception:  # noqa: BLE001 - no symmetric memory here: NCCL for every sum (got stays NaN)
        one_shot = None
    every = tp.all_gather_cols(got)  # [8, N * 1024]: every rank's result side by side
    same = all(torch.equal(every[:, r * 1024 : (r + 1) * 1024], got) for r in range(tp.size))
    ok = same and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    if _agree(ok, tp):
        tp = replace(tp, one_shot=one_shot, one_shot_bytes=ONE_SHOT_BYTES)
    return with_fused_norm(tp, push) if fused_norm else tp


def _agree(ok: bool, tp: TensorParallel) -> bool:
    """True on every rank when `ok` is true on every rank: all ranks take the same path."""
    agreed = torch.tensor([int(ok)], device="cuda")
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=tp.group)
    return bool(agreed.item())


def with_fused_norm(tp: TensorParallel, push: bool = True) -> TensorParallel:
    """`tp` with the fused sum + RMSNorm for decode-sized steps, where its symmetric memory works. Checked
    once on fresh data against the separate sum and norm: bit-identical on every rank, and close to them
    (rows of 1, 3 and the most it takes, twice each: both halves of its buffer). `push`
    (the `tp_gemv_push` switch): batch-1 row-parallel GEMVs write their rows into its buffers themselves
    (TensorParallel.row_parallel)."""
    from llmserve.kernels.sum_norm import FusedSumNorm

    if tp.size & (tp.size - 1):  # worlds of 2, 4, 8 only (a node's NVLink groups); it has run on 2
        return tp
    gen = torch.Generator("cuda").manual_seed(1234 + tp.rank)
    ok, fused = True, None
    try:
        fused = FusedSumNorm(tp.group, tp.rank, tp.size, ONE_SHOT_BYTES, push=push)
        n = 1024
        w = torch.rand(n, device="cuda", generator=torch.Generator("cuda").manual_seed(99)).to(torch.bfloat16)
        for rows in (1, 3, ONE_SHOT_BYTES // (4 * n), 1, 3, ONE_SHOT_BYTES // (4 * n)):
            x = torch.randn(rows, n, device="cuda", generator=gen)
            res = torch.randn(rows, n, device="cuda", generator=torch.Generator("cuda").manual_seed(rows))
            want_res, got_res = res.clone(), res.clone()
            want = rms_norm(tp.all_reduce(x.clone()), w, 1e-5, want_res)
            got = fused(x, w, 1e-5, got_res)
            every = tp.all_gather_cols(torch.cat([got.float(), got_res], 1))
            k = 2 * n
            ok &= all(torch.equal(every[:, r * k : (r + 1) * k], every[:, :k]) for r in range(tp.size))
            ok &= torch.allclose(got_res, want_res, rtol=1e-5, atol=1e-5)
            ok &= torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    except Exception:  # noqa: BLE001 - no symmetric memory or peer access here: the separate path
        ok = False
    return replace(tp, fused_norm=fused) if _agree(ok, tp) else tp


def check_shardable(mc: ModelConfig, n: int) -> None:
    """ConfigError naming MP_NUM and the model's numbers when its heads or MLP do not split n ways."""
    if n == 1:
        return
    bad = []
    if mc.num_attention_heads % n:
        bad.append(f"num_attention_heads={mc.num_attention_heads}")
    kvh = mc.num_key_value_heads
    if mc.mla is None and kvh % n and n % kvh:
        bad.append(f"num_key_value_heads={kvh} (must divide MP_NUM or be a multiple of it)")
    if mc.intermediate_size % n:
        bad.append(f"intermediate_size={mc.intermediate_size}")
    if mc.moe is not None and mc.moe.moe_intermediate_size % n:
        bad.append(f"moe_intermediate_size={mc.moe.moe_intermediate_size}")
    if bad:
        raise ConfigError(f"MP_NUM={n}: the model cannot be split {n} ways: {', '.join(bad)} not divisible by {n}")


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `size` holds of a model (all in rows / columns of the HF weights)."""

    mc: ModelConfig
    tp: TensorParallel

    @property
    def local_config(self) -> ModelConfig:
        """The model as one rank runs it: its heads, KV heads and intermediate features (vocabulary,
        hidden size and layers stay whole)."""
        n, mc = self.tp.size, self.mc
        return replace(
            mc,
            num_attention_heads=mc.num_attention_heads // n,
            num_key_value_heads=max(1, mc.num_key_value_heads // n),
            intermediate_size=mc.intermediate_size // n,
        )

    def q_rows(self) -> tuple[int, int]:
        h = self.mc.num_attention_heads // self.tp.size * self.mc.head_dim
        return self.tp.rank * h, (self.tp.rank + 1) * h

    def kv_rows(self) -> tuple[int, int]:
        n, r, kvh, d = self.tp.size, self.tp.rank, self.mc.num_key_value_heads, self.mc.head_dim
        first = r * kvh // n if kvh >= n else r // (n // kvh)
        count = max(1, kvh // n)
        return first * d, (first + count) * d

    def mlp_rows(self, intermediate: int | None = None) -> tuple[int, int]:
        """This rank's intermediate features of an MLP (default: the dense one's; an expert's: its own)."""
        i = (intermediate or self.mc.intermediate_size) // self.tp.size
        return self.tp.rank * i, (self.tp.rank + 1) * i

    def heads(self) -> tuple[int, int]:
        """This rank's query heads [first, last) (MLA: each rank attends with its heads over the whole latent)."""
        h = self.mc.num_attention_heads // self.tp.size
        return self.tp.rank * h, (self.tp.rank + 1) * h

    def vocab_rows(self) -> tuple[int, int]:
        """Rows of the embedding / LM head: ceil(V / N) per rank, the last rank's padded by the model."""
        per = self.vocab_per_rank
        return min(self.mc.vocab_size, self.tp.rank * per), min(self.mc.vocab_size, (self.tp.rank + 1) * per)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.mc.vocab_size // self.tp.size)


def vocab_rows(r: WeightReader, name: str, shard: Shard) -> torch.Tensor:
    """The embedding / LM head rows this rank holds, zero-padded to ceil(V / N)."""
    if shard.tp.size == 1:
        return r.get(name)
    lo, hi = shard.vocab_rows()
    t = r.get(name, (0, lo, hi))
    pad = shard.vocab_per_rank - t.shape[0]
    return F.pad(t, (0, 0, 0, pad)) if pad else t


def gather_logits(local: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Each rank's scores of its vocabulary rows [T, V / N] -> every row's [T, V]."""
    if shard.tp.size == 1:
        return local
    return shard.tp.all_gather_cols(local)[:, : shard.mc.vocab_size]


def embed(ids: torch.Tensor, table: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Vocabulary-parallel lookup: each rank fills the rows of the ids it holds, zeros elsewhere, and
    the all-reduce puts every row together."""
    if shard.tp.size == 1:
        return F.embedding(ids, table)
    lo = shard.vocab_rows()[0]
    local = ids - lo
    mine = (local >= 0) & (local < table.shape[0])
    h = F.embedding(torch.where(mine, local, torch.zeros_like(local)), table)
    h = h * mine.unsqueeze(-1).to(h.dtype)
    return shard.tp.all_reduce(h)
