"""Host-side preparation of one step's inputs, uploaded in a single copy.

Everything the model needs per step (token ids, positions, KV slots, chunk
offsets, context lengths, block tables, attention work items) is int32; it is
packed into one pinned host buffer and copied to the device at once, so input
preparation costs one transfer however many requests the batch holds. Also the
inputs filled in on the device: the tokens of PENDING inputs (overlapped steps)
and structured output's token masks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from llmserve.engine.request import PENDING
from llmserve.engine.runner_contract import SeqChunk
from llmserve.kernels.attention import AttnMeta, tile_tokens


@dataclass
class FedChunk(SeqChunk):
    """A chunk whose input tokens are given (a proposer's own tokens, not the request's)."""

    ids: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.ids


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    meta: AttnMeta
    sample_idx: torch.Tensor  # packed-token index of each sampled position (host_arrays' sample_tok)
    # Steps with prompt-logprob chunks only: their prompt positions (packed-token index), chunk after
    # chunk, and the prompt token each predicts.
    plp_idx: torch.Tensor | None = None
    plp_target: torch.Tensor | None = None


def host_arrays(chunks: list[SeqChunk], block_size: int) -> dict[str, np.ndarray]:
    """ids, positions, slots, q_lens, seq_lens, block tables (padded) and sampled rows, as numpy; and
    plp_tok / plp_target (StepInputs) when a chunk asks for prompt logprobs."""
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
    # Inputs drawn by the step still in flight (overlapped scheduling): filled in on the device.
    pending = np.flatnonzero(ids == PENDING)
    ids[pending] = 0
    cu_q = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu_q[1:])
    sampled = np.fromiter((i for i, c in enumerate(chunks) if c.sample), dtype=np.int64)
    # Sampled positions: each sampling chunk's last token, or its last 1 + k with k drafts to verify.
    sample_tok = cu_q[1:][sampled] - 1
    rows = np.fromiter((c.num_sampled_rows for c in chunks if c.sample), dtype=np.int64, count=len(sampled))
    if rows.size and rows.max() > 1:
        row_seq = np.repeat(np.arange(len(sampled)), rows)
        first = np.cumsum(rows) - rows
        sample_tok = sample_tok[row_seq] - (rows[row_seq] - 1) + (np.arange(int(rows.sum())) - first[row_seq])
    out = {}
    counts = [c.num_prompt_logprobs for c in chunks] if any(c.prompt_logprobs for c in chunks) else [0]
    if sum(counts):
        plp_seq = np.repeat(np.arange(B), counts)
        plp_first = np.cumsum(counts) - counts
        out["plp_tok"] = cu_q[plp_seq] + (np.arange(len(plp_seq)) - plp_first[plp_seq])
        out["plp_target"] = np.fromiter(chain.from_iterable(c.prompt_logprob_targets() for c in chunks), np.int64)
    return dict(
        out,
        ids=ids,
        positions=positions,
        slots=slots,
        q_lens=q_lens,
        seq_lens=starts + q_lens,
        bt=bt,
        cu_q=cu_q,
        sampled=sampled,
        sample_tok=sample_tok,
        pending=pending,
        seq_of_pending=seq_of[pending],
    )


def fill_pending(
    ids: torch.Tensor, a: dict, chunks: list[SeqChunk], last_tokens: torch.Tensor, last_rows: dict[str, int]
) -> None:
    """Write into `ids` (device) the tokens the last step drew (`last_tokens`, a row per request:
    `last_rows`) for this step's PENDING inputs (host arrays `a` of `chunks`)."""
    pend = a["pending"]
    if not pend.size:
        return
    src = [last_rows[chunks[i].request.req_id] for i in a["seq_of_pending"]]
    idx = torch.from_numpy(np.stack([pend, np.asarray(src, dtype=np.int64)])).to(ids.device, non_blocking=True)
    ids.index_copy_(0, idx[0], last_tokens.index_select(0, idx[1]).to(ids.dtype))


def apply_bitmasks(logits: torch.Tensor, sampled: list[SeqChunk], vocab_size: int, uploader: Uploader) -> None:
    """Structured output: -inf, in place, for every token a chunk's grammar does not allow next (its
    bitmask, base.py; the same for each of its rows). The masks go up in one upload, unpacked on the device."""
    words = -(-vocab_size // 32)
    rows = np.full((logits.shape[0], words), -1, dtype=np.int32)  # all bits set: unconstrained
    r = 0
    for c in sampled:
        if c.token_bitmask is not None:
            rows[r : r + c.num_sampled_rows] = c.bitmask()
        r += c.num_sampled_rows
    (dev,) = uploader.upload([rows])
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((dev.unsqueeze(-1) >> shifts) & 1).view(rows.shape[0], words * 32)[:, :vocab_size]
    logits.masked_fill_(allowed == 0, float("-inf"))


def prefill_inputs(
    num_tokens: int, mc, block_size: int, vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttnMeta]:
    """(ids, slots, attention metadata) of one prompt of `num_tokens` random tokens over blocks 0, 1, ...
    of a cache of its own: the KV sizing's largest step (runner._warmup_prefill). `mc`: the model config
    (this rank's heads)."""
    nb = -(-num_tokens // block_size)
    i32 = dict(dtype=torch.int32, device=device)
    bt = torch.arange(nb, **i32)[None, :]
    block_t = tile_tokens(mc.num_attention_heads, mc.num_key_value_heads, decode_only=False)
    tiles = -(-num_tokens // block_t)
    meta = AttnMeta(
        torch.tensor([0, num_tokens], **i32),
        torch.tensor([num_tokens], **i32),
        bt,
        torch.zeros(tiles, **i32),
        torch.arange(tiles, **i32) * block_t,
        block_t,
    )
    ids = torch.randint(0, vocab_size, (num_tokens,), **i32)
    slots = torch.arange(num_tokens, **i32)
    return ids, slots, meta


def work_items(q_lens: np.ndarray, block_t: int) -> tuple[np.ndarray, np.ndarray]:
    """(chunk, first query token) of each attention work item of BLOCK_T tokens."""
    tiles = (q_lens + block_t - 1) // block_t
    item_seq = np.repeat(np.arange(len(q_lens)), tiles)
    first = np.cumsum(tiles) - tiles
    return item_seq, (np.arange(int(tiles.sum())) - first[item_seq]) * block_t


class PinnedStaging:
    """A ring of pinned host buffers used in turn, each reused only once its last copy to the device
    is done: with overlapped steps the host packs step N+1 while step N's copies may still be queued.
    A step may upload several times (the MTP module after the step, each link of a proposal chain),
    and a buffer's copy waits behind the step's kernels: with only two buffers, the third upload of a
    step would wait for the device to finish its first, and the host would stop running ahead."""

    SLOTS = 8

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.pinned = device.type == "cuda"
        self.capacity = capacity
        self.bufs: list[torch.Tensor | None] = [None] * self.SLOTS  # allocated when first taken
        self.events = [torch.cuda.Event() if self.pinned else None for _ in range(self.SLOTS)]
        self.turn = 0

    def take(self, size: int) -> torch.Tensor:
        """A host buffer of at least `size` int32 that no copy in flight reads."""
        self.turn = (self.turn + 1) % self.SLOTS
        if self.events[self.turn] is not None:
            self.events[self.turn].synchronize()
        buf = self.bufs[self.turn]
        if buf is None or size > buf.numel():
            n = max(self.capacity, 2 * size if buf is not None else size)
            buf = self.bufs[self.turn] = torch.empty(n, dtype=torch.int32, pin_memory=self.pinned)
        return buf

    def copied(self) -> None:
        """Call right after enqueuing the copy out of the buffer `take` gave."""
        if self.events[self.turn] is not None:
            self.events[self.turn].record()


class Uploader:
    """Packs int32 sections into a pinned buffer and copies them to the device in one go."""

    def __init__(self, device: torch.device, capacity: int = 1 << 20) -> None:
        self.device = device
        self.staging = PinnedStaging(device, capacity)

    def upload(self, sections: list[np.ndarray], out: torch.Tensor | None = None) -> list[torch.Tensor]:
        sizes = [a.size for a in sections]
        # 16-byte aligned sections: Triton specialises kernels on pointer alignment, and a
        # section alignment that changed from step to step would recompile them mid-run.
        spans = [-(-n // 4) * 4 for n in sizes]
        total = sum(spans)
        buf = self.staging.take(total)
        host = buf.numpy()
        off = 0
        for a, n, span in zip(sections, sizes, spans):
            host[off : off + n] = a.reshape(-1)
            off += span
        if out is None:
            out = torch.empty(total, dtype=torch.int32, device=self.device)
        out[:total].copy_(buf[:total], non_blocking=True)
        self.staging.copied()
        views, off = [], 0
        for a, n, span in zip(sections, sizes, spans):
            views.append(out[off : off + n].view(a.shape))
            off += span
        return views
