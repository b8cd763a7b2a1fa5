"""Host side of the paged graph: pack one step's chunks into the graph's input arrays.

See docs/model_format.md for the contract. Multi-token chunks (prefill, or several
tokens of one sequence) are cut into query tiles of Qc consecutive tokens; single
tokens (decode) become single-query rows, so a decode token never pays for a
prefill-sized tile. Either group gets one dummy row when empty (its output is never
read), so the graph never sees a zero-size tensor.
"""

from __future__ import annotations

import numpy as np

from llmserve.engine.runner_contract import SeqChunk

MAX_TILE = 64  # largest query tile; K/V gather memory is (T / Qc) x L x kv_dim per layer


def tile_size(chunks: list[SeqChunk], max_tile: int = MAX_TILE) -> int:
    longest = max((c.num_tokens for c in chunks if c.num_tokens > 1), default=1)
    return min(max_tile, 1 << (longest - 1).bit_length())  # a power of two: few distinct shapes


def build_step_inputs(chunks: list[SeqChunk], block_size: int, max_tile: int = MAX_TILE) -> dict[str, np.ndarray]:
    """Graph inputs for one step (INPUT_SPECS names), plus "num_logits": real rows of the logits
    (sampled chunks first, then prompt-logprob positions)."""
    if not chunks:
        raise ValueError("empty step")
    n = np.array([c.num_tokens for c in chunks], np.int64)
    start = np.array([c.start for c in chunks], np.int64)
    offsets = np.concatenate([[0], np.cumsum(n)])
    total = int(offsets[-1])

    blocks_needed = -(-(start + n) // block_size)
    block_tables = np.zeros((len(chunks), int(blocks_needed.max())), np.int64)
    for b, c in enumerate(chunks):
        table = c.request.block_table
        if len(table) < blocks_needed[b]:
            raise ValueError(
                f"request {c.request.req_id}: {len(table)} blocks cannot hold {start[b] + n[b]} tokens "
                f"(block_size {block_size})"
            )
        block_tables[b, : blocks_needed[b]] = table[: blocks_needed[b]]

    seq_of_tok = np.repeat(np.arange(len(chunks)), n)
    positions = np.arange(total, dtype=np.int64) - offsets[seq_of_tok] + start[seq_of_tok]
    slot_mapping = block_tables[seq_of_tok, positions // block_size] * block_size + positions % block_size
    input_ids = np.fromiter((t for c in chunks for t in c.token_ids), np.int64, total)

    qc = tile_size(chunks, max_tile)
    out_index = np.empty(total, np.int64)
    tile_seq, tile_tok = [], []
    multi = [b for b in range(len(chunks)) if n[b] > 1]
    for b in multi:
        num_tiles = -(-int(n[b]) // qc)
        idx = np.arange(num_tiles * qc, dtype=np.int64)
        out_index[offsets[b] : offsets[b + 1]] = len(tile_tok) * qc + idx[: n[b]]
        tile_tok.extend(np.minimum(idx, n[b] - 1).reshape(num_tiles, qc) + offsets[b])  # pad: repeat last token
        tile_seq.extend([b] * num_tiles)
    if not tile_tok:
        tile_seq, tile_tok = [0], [np.zeros(qc, np.int64)]
    single = np.flatnonzero(n == 1)
    out_index[offsets[single]] = len(tile_tok) * qc + np.arange(len(single))
    row_seq = single if len(single) else np.zeros(1, np.int64)

    # Logits rows: the sampled chunks' last tokens (the last 1 + k with k drafts to verify), then the prompt positions of chunks that ask for
    # prompt logprobs (chunk after chunk), which execute splits off again.
    rows = [offsets[b + 1] - c.num_sampled_rows + j for b, c in enumerate(chunks) for j in range(c.num_sampled_rows)]
    rows += [offsets[b] + i for b, c in enumerate(chunks) for i in range(c.num_prompt_logprobs)]
    return {
        "input_ids": input_ids,
        "positions": positions,
        "slot_mapping": slot_mapping,
        "block_tables": block_tables,
        "block_size": np.array([block_size], np.int64),
        "tile_seq": np.array(tile_seq, np.int64),
        "tile_tok": np.stack(tile_tok).astype(np.int64),
        "row_seq": row_seq.astype(np.int64),
        "row_tok": offsets[row_seq].reshape(-1, 1).astype(np.int64),
        "out_index": out_index,
        "logits_index": np.array(rows or [total - 1], np.int64),  # one throw-away row when none is wanted
        "num_logits": np.array(len(rows)),
    }
