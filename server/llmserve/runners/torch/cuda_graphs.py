"""Decode steps replayed as CUDA graphs, one graph per bucketed batch size.

A decode-only step launches ~10 kernels per layer; at small batches the GPU
would wait on the host between them. Each bucket's graph is captured once
over static input buffers (token ids, positions, slots, context lengths,
block tables) laid out in one int32 device buffer, so a step is one host to
device copy into that buffer plus one replay. Padded rows have context length
0 and slot -1: they attend to nothing and write no KV.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .inputs import PinnedStaging
from .kernels.attention import AttnMeta, tile_tokens

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def decode_splits(batch: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """Split-KV factor: enough programs to fill the GPU twice over."""
    return int(min(max_splits, max(1, -(-2 * num_sms // (batch * num_kv_heads)))))


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, max_batch: int, max_blocks: int, num_sms: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        dev = kv_cache.device
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        mb = self.max_batch = max_batch
        self.max_blocks = max_blocks
        # static int32 layout: ids | positions | slots | seq_lens | block tables
        self.sizes = [mb, mb, mb, mb, mb * max_blocks]
        self.offsets = np.cumsum([0] + self.sizes)
        self.static = torch.zeros(int(self.offsets[-1]), dtype=torch.int32, device=dev)
        self.staging = PinnedStaging(dev, int(self.offsets[-1]))
        s = self._views(self.static)
        self.ids, self.pos, self.slots, self.seq_lens, self.bt = s
        self.cu_q = torch.arange(mb + 1, dtype=torch.int32, device=dev)
        self.item_seq = torch.arange(mb, dtype=torch.int32, device=dev)
        self.item_qstart = torch.zeros(mb, dtype=torch.int32, device=dev)
        H, KVH = model.num_heads, model.num_kv_heads
        self.block_t = tile_tokens(H, KVH, decode_only=True)
        self.num_sms = num_sms
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def _views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        o = self.offsets
        v = [buf[o[i] : o[i + 1]] for i in range(5)]
        v[4] = v[4].view(self.max_batch, self.max_blocks)
        return v

    def _meta(self, bs: int) -> AttnMeta:
        KVH = self.model.num_kv_heads
        return AttnMeta(
            self.cu_q[: bs + 1],
            self.seq_lens[:bs],
            self.bt[:bs],
            self.item_seq[:bs],
            self.item_qstart[:bs],
            self.block_t,
            decode_splits(bs, KVH, self.num_sms),
        )

    def _run(self, bs: int) -> torch.Tensor:
        hidden = self.model.forward(self.ids[:bs], self.pos[:bs], self.slots[:bs], self._meta(bs), self.kv_cache)
        return self.model.logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        self.slots.fill_(-1)
        self.seq_lens.fill_(1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.buckets):  # largest first: later graphs reuse its pool
                self._run(bs)  # warm up (compiles kernels, picks cuBLAS algorithms)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool, stream=stream):
                    self.logits[bs] = self._run(bs)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[bs] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def replay(self, a: dict[str, np.ndarray], fill_ids=None) -> torch.Tensor:
        """Logits [bucket, V] of a decode-only step given host arrays (inputs.host_arrays);
        `fill_ids(ids)` may then write device-side inputs into the static ids before the replay."""
        B = a["ids"].shape[0]
        bs = self.bucket(B)
        staging = self.staging.take(int(self.offsets[-1]))
        host = self._views(staging)
        ids, pos, slots, lens, bt = (t.numpy() for t in host)
        ids[:B], pos[:B], slots[:B], lens[:B] = a["ids"], a["positions"], a["slots"], a["seq_lens"]
        ids[B:bs], pos[B:bs], slots[B:bs], lens[B:bs] = 0, 0, -1, 0
        w = a["bt"].shape[1]
        bt[:B, :w] = a["bt"]
        # one copy: everything up to the end of the block-table rows in use
        end = int(self.offsets[4]) + bs * self.max_blocks
        self.static[:end].copy_(staging[:end], non_blocking=True)
        self.staging.copied()
        if fill_ids is not None:
            fill_ids(self.ids[:B])
        self.graphs[bs].replay()
        return self.logits[bs]
