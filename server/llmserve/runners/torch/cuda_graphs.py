"""Decode and verification steps replayed as CUDA graphs, one graph per (queries per sequence,
bucketed batch size).

A decode-only step launches ~10 kernels per layer; at small batches the GPU
would wait on the host between them. Each bucket's graph is captured once
over static input buffers (token ids, positions, slots, context lengths,
block tables) laid out in one int32 device buffer, so a step is one host to
device copy into that buffer plus one replay. Padded rows have context length
0 and slot -1: they attend to nothing and write no KV.

Speculative decoding's verification steps (every sequence: its last token and k drafts) get graphs
of q = k + 1 queries per sequence, for k = 1..SPECULATE_MAX_DRAFT_TOKEN_NUM and batches of up to
MAX_VERIFY_TOKENS tokens. A sequence with fewer drafts is padded to q (`VerifyPack`): its extra
queries write no KV and come after its real ones, so the causal mask hides them from those.

A head proposer that captures its work (head_proposer.py: MTP) gets a second graph per key, captured
right after the step graph over the same pool: its `graph_forward` over that graph's static inputs,
hidden output and the head's static buffers; the head replays it (`replay_head`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from llmserve.engine.request import PENDING
from llmserve.engine.runner_contract import SeqChunk
from llmserve.kernels.attention import AttnMeta, tile_tokens
from llmserve.layers.kv_cache import KVCache
from llmserve.runners.torch.inputs import PinnedStaging, StepInputs

log = logging.getLogger(__name__)

MAX_VERIFY_TOKENS = 512  # larger verification batches run eagerly (and the draft-length rule avoids them)
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def decode_splits(batch: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """Split-KV factor: enough programs to fill the GPU twice over."""
    return int(min(max_splits, max(1, -(-2 * num_sms // (batch * num_kv_heads)))))


@dataclass
class VerifyPack:
    """A verification step that a graph replays (`DecodeGraphs.verify_q`): `load` packs its chunks into the static
    buffers itself, in one pass, without inputs.host_arrays: the serial step's host time is on the critical path
    (docs/speculative.md), and for a few sequences numpy's per-call cost was most of it. Each chunk gets q queries:
    its real tokens, then pads that repeat its last position (a valid rotary index) with slot -1 (no KV written)
    and id 0; seq_lens count the pads, so each real query sits where its position says and the causal mask hides
    the pads from it."""

    chunks: list[SeqChunk]
    block_size: int
    q: int

    @property
    def rows(self) -> np.ndarray:
        """The padded rows of the real tokens (all sampled), in order."""
        q = self.q
        return np.fromiter(chain.from_iterable(range(i * q, i * q + c.num_tokens) for i, c in enumerate(self.chunks)), np.int64)  # fmt: skip


class DecodeGraphs:
    def __init__(
        self,
        model,
        kv_cache: KVCache,
        max_batch: int,
        max_blocks: int,
        num_sms: int,
        max_draft: int = 0,
        head=None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        # A head proposer (head_proposer.HeadProposer): with static buffers of its own, each graph gets
        # a second one that runs the head's work over the step's positions from the first's hidden states.
        self.head = head
        dev = kv_cache.data.device
        mb = self.max_batch = max_batch
        decode = [b for b in BUCKETS if b < max_batch] + [max_batch]
        # q -> its batch buckets: decode (q = 1) up to max_batch, verification up to MAX_VERIFY_TOKENS tokens.
        self.buckets = {1: decode}
        for q in range(2, max_draft + 2):
            self.buckets[q] = [b for b in decode if b * q <= MAX_VERIFY_TOKENS]
        self.max_blocks = max_blocks
        mt = max(b * q for q, bs in self.buckets.items() for b in bs)  # most tokens of one graph
        # static int32 layout: ids | positions | slots | seq_lens | block tables
        self.sizes = [mt, mt, mt, mb, mb * max_blocks]
        self.offsets = np.cumsum([0] + self.sizes)
        self.static = torch.zeros(int(self.offsets[-1]), dtype=torch.int32, device=dev)
        self.staging = PinnedStaging(dev, int(self.offsets[-1]))
        self.ids, self.pos, self.slots, self.seq_lens, self.bt = self._views(self.static)
        self.block_t = tile_tokens(model.local.num_attention_heads, model.local.num_key_value_heads, decode_only=True)
        i32 = dict(dtype=torch.int32, device=dev)
        # Per q: chunk offsets, and the work items (chunk, first query) of BLOCK_T queries each.
        self.cu_q, self.items = {}, {}
        for q in self.buckets:
            tiles = -(-q // self.block_t)
            self.cu_q[q] = torch.arange(mb + 1, **i32) * q
            seq = torch.arange(mb, **i32).repeat_interleave(tiles)
            self.items[q] = (tiles, seq, (torch.arange(tiles, **i32) * self.block_t).repeat(mb))
        self.num_sms = num_sms
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.hidden: dict[tuple[int, int], torch.Tensor] = {}  # final hidden states (for a head proposer)
        self.last_hidden: torch.Tensor | None = None  # those of the last replay, [bucket * q, hidden]
        self.last_key: tuple[int, int] = (1, 0)  # (q, bucket) of the last replay
        self.head_static = head.graph_buffers(mt, dev) if head is not None else None  # None: no head graphs
        self.head_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.head_out: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None
        self._np_views: dict[int, tuple[torch.Tensor, list[np.ndarray]]] = {}  # staging buffer -> its views

    def _host_views(self, staging: torch.Tensor) -> list[np.ndarray]:
        """`_views` of a staging buffer as numpy (cached: the ring's buffers are few and kept)."""
        cached = self._np_views.get(key := staging.data_ptr())
        if cached is None or cached[0] is not staging:
            host, o = staging.numpy(), self.offsets
            views = [host[o[i] : o[i + 1]] for i in range(4)] + [
                host[o[4] : o[5]].reshape(self.max_batch, self.max_blocks)
            ]
            self._np_views[key] = cached = (staging, views)
        return cached[1]

    @staticmethod
    def _pack_verify(p: VerifyPack, ids, pos, slots, lens, bt) -> None:
        """`VerifyPack`'s chunks into the host views."""
        q, size = p.q, p.block_size
        tok, at, slot = [], [], []
        for i, c in enumerate(p.chunks):
            table, n, s = c.request.block_table, c.num_tokens, c.start
            tok += c.token_ids
            tok += [0] * (q - n)
            at += range(s, s + n)
            at += [s + n - 1] * (q - n)
            slot += [table[t // size] * size + t % size for t in range(s, s + n)]
            slot += [-1] * (q - n)
            lens[i] = s + q
            bt[i, : len(table)] = table
            bt[i, len(table) :] = 0
        T = len(tok)
        ids[:T], pos[:T], slots[:T] = tok, at, slot

    def _views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        o = self.offsets
        v = [buf[o[i] : o[i + 1]] for i in range(5)]
        v[4] = v[4].view(self.max_batch, self.max_blocks)
        return v

    def _meta(self, bs: int, q: int) -> AttnMeta:
        tiles, seq, qstart = self.items[q]
        n = bs * tiles
        splits = decode_splits(n, self.model.local.num_key_value_heads, self.num_sms)
        return AttnMeta(
            self.cu_q[q][: bs + 1], self.seq_lens[:bs], self.bt[:bs], seq[:n], qstart[:n], self.block_t, splits
        )

    def _run(self, bs: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = bs * q
        hidden = self.model.forward(self.ids[:t], self.pos[:t], self.slots[:t], self._meta(bs, q), self.kv_cache)
        return hidden, self.model.logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        self.slots.fill_(-1)
        self.seq_lens.fill_(1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # Largest first (the most tokens): later graphs reuse its memory pool.
        keys = sorted(((q, b) for q, bs in self.buckets.items() for b in bs), key=lambda k: -k[0] * k[1])
        with torch.cuda.stream(stream):
            for q, bs in keys:
                self._run(bs, q)  # warm up (compiles kernels, picks cuBLAS algorithms)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool, stream=stream):
                    self.hidden[q, bs], self.logits[q, bs] = self._run(bs, q)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[q, bs] = g
                if self.head_static is not None:
                    self.head.graph_forward(self, (q, bs))  # warm up
                    g = self.head_graphs[q, bs] = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self.pool, stream=stream):
                        self.head_out[q, bs] = self.head.graph_forward(self, (q, bs))
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured CUDA graphs: %s", {q: bs for q, bs in self.buckets.items()})

    def inputs(self, key: tuple[int, int] | None = None) -> StepInputs:
        """The inputs of graph `key` (default: the last replayed) in its padded layout (static
        buffers): positions, slots, attention metadata (pad rows: slot -1, nothing to attend)."""
        q, bs = key or self.last_key
        t = bs * q
        return StepInputs(self.ids[:t], self.pos[:t], self.slots[:t], self._meta(bs, q), self.ids[:0])

    def replay_head(self, key: tuple[int, int]) -> None:
        """The head's graph `key`, over what the head wrote into its static buffers (its output: `head_out[key]`)."""
        self.head_graphs[key].replay()

    def verify_q(self, chunks: list[SeqChunk]) -> int:
        """q when a graph replays this step as a verification step, else 0: every chunk a sampling chunk of its
        last token and drafts (q - 1 at most), none with prompt logprobs or a PENDING input, a bucket for
        them, their block tables within the graphs'."""
        q = 1 + max((len(c.draft_token_ids) for c in chunks), default=0)
        if q == 1 or self.bucket(len(chunks), q) is None:
            return 0
        for c in chunks:
            if not c.sample or c.num_tokens != c.num_sampled_rows or c.num_prompt_logprobs:
                return 0
            if len(c.request.block_table) > self.max_blocks or PENDING in c.token_ids:
                return 0
        return q

    def bucket(self, batch: int, q: int = 1) -> int | None:
        return next((b for b in self.buckets.get(q, ()) if b >= batch), None)

    def replay(self, a: dict[str, np.ndarray] | VerifyPack, fill_ids=None, q: int = 1) -> torch.Tensor:
        """Logits [bucket * q, V] of a decode-only step (q = 1) given its host arrays, or of a padded
        verification step (`VerifyPack`); `fill_ids(ids)` may then write device-side inputs
        into the static ids before the replay."""
        bs = self.load(a, fill_ids, q)
        self.graphs[q, bs].replay()
        self.last_hidden, self.last_key = self.hidden[q, bs], (q, bs)
        return self.logits[q, bs]

    def load(self, a: dict[str, np.ndarray] | VerifyPack, fill_ids=None, q: int = 1) -> int:
        """Copy a step's inputs into the static buffers (padding the bucket); returns the bucket.
        `_run(bucket, q)` then computes what the graph would (eagerly: how the tests check graph inputs on a CPU)."""
        B = len(a.chunks) if isinstance(a, VerifyPack) else a["seq_lens"].shape[0]
        bs = self.bucket(B, q)
        T, Tb = B * q, bs * q
        staging = self.staging.take(int(self.offsets[-1]))
        ids, pos, slots, lens, bt = self._host_views(staging)
        if isinstance(a, VerifyPack):
            self._pack_verify(a, ids, pos, slots, lens, bt)
        else:
            ids[:T], pos[:T], slots[:T], lens[:B] = a["ids"], a["positions"], a["slots"], a["seq_lens"]
            w = a["bt"].shape[1]
            bt[:B, :w] = a["bt"]
            # The rest are valid block ids (0), never stale bytes of the staging buffer: a verification
            # step's pad queries read keys past their sequence's last block (masked, but read).
            bt[:B, w:] = 0
        ids[T:Tb], pos[T:Tb], slots[T:Tb], lens[B:bs] = 0, 0, -1, 0
        bt[B:bs] = 0
        # one copy: everything up to the end of the block-table rows in use
        end = int(self.offsets[4]) + bs * self.max_blocks
        self.static[:end].copy_(staging[:end], non_blocking=True)
        self.staging.copied()
        if fill_ids is not None:
            fill_ids(self.ids[:B])
        return bs
