"""Host-side preparation of one step's inputs, uploaded in a single copy.

Everything the model needs per step (token ids, positions, KV slots, chunk
offsets, context lengths, block tables, attention work items) is int32; it is
packed into one pinned host buffer and copied to the device at once, so input
preparation costs one transfer however many requests the batch holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from llmserve.runners.base import SeqChunk

from .kernels.attention import AttnMeta


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    meta: AttnMeta
    sample_idx: torch.Tensor  # packed-token index of each sampled chunk's last token
    num_sampled: int


def host_arrays(chunks: list[SeqChunk], block_size: int) -> dict[str, np.ndarray]:
    """ids, positions, slots, q_lens, seq_lens, block tables (padded) and sampled rows, as numpy."""
    B = len(chunks)
    q_lens = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=B)
    starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=B)
    ids = np.fromiter(chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64)
    tables = [c.request.block_table for c in chunks]
    n_blocks = np.fromiter((len(t) for t in tables), dtype=np.int64, count=B)
    width = max(1, int(n_blocks.max()) if B else 1)
    bt = np.zeros((B, width), dtype=np.int64)
    bt[np.arange(width)[None, :] < n_blocks[:, None]] = np.fromiter(chain.from_iterable(tables), dtype=np.int64)
    T = int(q_lens.sum())
    if T == B:  # decode only: one token per chunk
        seq_of = np.arange(B)
        positions = starts
    else:
        seq_of = np.repeat(np.arange(B), q_lens)
        first = np.cumsum(q_lens) - q_lens
        positions = starts[seq_of] + (np.arange(T) - first[seq_of])
    slots = bt[seq_of, positions // block_size] * block_size + positions % block_size
    cu_q = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu_q[1:])
    sampled = np.fromiter((i for i, c in enumerate(chunks) if c.sample), dtype=np.int64)
    return dict(
        ids=ids,
        positions=positions,
        slots=slots,
        q_lens=q_lens,
        seq_lens=starts + q_lens,
        bt=bt,
        cu_q=cu_q,
        sampled=sampled,
        sample_tok=cu_q[1:][sampled] - 1,
    )


def work_items(q_lens: np.ndarray, block_t: int) -> tuple[np.ndarray, np.ndarray]:
    """(chunk, first query token) of each attention work item of BLOCK_T tokens."""
    tiles = (q_lens + block_t - 1) // block_t
    item_seq = np.repeat(np.arange(len(q_lens)), tiles)
    first = np.cumsum(tiles) - tiles
    return item_seq, (np.arange(int(tiles.sum())) - first[item_seq]) * block_t


class Uploader:
    """Packs int32 sections into a pinned buffer and copies them to the device in one go."""

    def __init__(self, device: torch.device, capacity: int = 1 << 20) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._buf = torch.empty(capacity, dtype=torch.int32, pin_memory=self.pinned)

    def upload(self, sections: list[np.ndarray], out: torch.Tensor | None = None) -> list[torch.Tensor]:
        sizes = [a.size for a in sections]
        # 16-byte aligned sections: Triton specialises kernels on pointer alignment, and a
        # section alignment that changed from step to step would recompile them mid-run.
        spans = [-(-n // 4) * 4 for n in sizes]
        total = sum(spans)
        if total > self._buf.numel():
            self._buf = torch.empty(2 * total, dtype=torch.int32, pin_memory=self.pinned)
        host = self._buf.numpy()
        off = 0
        for a, n, span in zip(sections, sizes, spans):
            host[off : off + n] = a.reshape(-1)
            off += span
        if out is None:
            out = torch.empty(total, dtype=torch.int32, device=self.device)
        out[:total].copy_(self._buf[:total], non_blocking=True)
        views, off = [], 0
        for a, n, span in zip(sections, sizes, spans):
            views.append(out[off : off + n].view(a.shape))
            off += span
        return views
