"""The (token, slot) pairs of a routed batch, grouped by expert and padded per expert to a GEMM's row block.

`moe_align(ids, n_experts, block_m)`: ids [T, k] (the router's choices) -> `Aligned`:
  pairs [n_blocks * block_m] int32: pair p = t * k + s of token t's slot s, expert after expert, each expert's
    run padded to a multiple of block_m with P = T * k (no pair: the GEMMs skip such rows);
  block_expert [n_blocks] int32: the expert of each block_m rows, -1 for blocks past the last expert's (the GEMMs
    return at once there).

n_blocks = T * k // block_m + min(E, T * k): an upper bound of sum_e ceil(c_e / block_m) over the counts c_e
(each expert that has pairs wastes less than one block), at most the brief's cdiv(T * k + E * (block_m - 1),
block_m) and far less at decode (T = 1, k = 8: 8 blocks, not E * 15 / 16 of them). It depends on the shapes
alone, and nothing here reads a tensor on the host: no sync, CUDA-graph capturable (counts by scatter_add, not
bincount, which sizes its output from the data's max; argsort and searchsorted keep static shapes).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Aligned(NamedTuple):
    pairs: torch.Tensor  # [n_blocks * block_m] int32, P = T * k for padding
    block_expert: torch.Tensor  # [n_blocks] int32, -1: an empty block
    block_m: int


def n_blocks(n_pairs: int, n_experts: int, block_m: int) -> int:
    """The static number of row blocks for n_pairs pairs over n_experts (module doc)."""
    return n_pairs // block_m + min(n_experts, n_pairs)


def moe_align(ids: torch.Tensor, n_experts: int, block_m: int) -> Aligned:
    """ids [T, k] -> the pairs sorted by expert and padded per expert to block_m rows (module doc)."""
    flat = ids.reshape(-1).long()
    P = flat.numel()
    nb = n_blocks(P, n_experts, block_m)
    counts = torch.zeros(n_experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # each expert's run in the padded buffer ends here
    order = flat.argsort(stable=True)  # pair ids, expert after expert (token order within one)
    expert_of = flat[order]
    rank = torch.arange(P, device=ids.device) - (counts.cumsum(0) - counts)[expert_of]  # position within its run
    dest = ends[expert_of] - padded[expert_of] + rank
    pairs = torch.full((nb * block_m,), P, dtype=torch.int32, device=ids.device)
    pairs.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(nb, device=ids.device) * block_m
    expert = torch.searchsorted(ends, starts, right=True)  # the first expert whose run ends past the block's start
    block_expert = torch.where(expert < n_experts, expert, -1).to(torch.int32)
    return Aligned(pairs, block_expert, block_m)


def moe_align_ref(ids: torch.Tensor, n_experts: int, block_m: int) -> Aligned:
    """The same by a Python loop over the experts (tests)."""
    flat = ids.reshape(-1).tolist()
    P = len(flat)
    nb = n_blocks(P, n_experts, block_m)
    pairs: list[int] = []
    experts: list[int] = []
    for e in range(n_experts):
        mine = [p for p, x in enumerate(flat) if x == e]
        if not mine:
            continue
        nblk = -(-len(mine) // block_m)
        pairs += mine + [P] * (nblk * block_m - len(mine))
        experts += [e] * nblk
    assert len(experts) <= nb
    pairs += [P] * ((nb - len(experts)) * block_m)
    experts += [-1] * (nb - len(experts))
    return Aligned(torch.tensor(pairs, dtype=torch.int32), torch.tensor(experts, dtype=torch.int32), block_m)
