"""KV-cache blocks: free list, reference counts and prefix caching.

A block holds `block_size` consecutive tokens of one sequence. Full blocks are
identified by a hash chained over all tokens up to and including the block, so
two requests whose prompts share a prefix share those blocks (ref count > 1).
A freed block keeps its hash until it is handed out again: the free list is
least-recently-freed first, so recently used prefixes stay reusable longest.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from llmserve.engine.request import Request

_ROOT_HASH = 0x9E3779B97F4A7C15


def block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] = ()  # of a hashed block, to rule out hash collisions


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"need at least one KV block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._by_hash: dict[int, int] = {}
        # Counters for stats: prompt tokens looked up / served from the cache.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- queries -------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, req: Request) -> list[int]:
        """Cached blocks covering a prefix of the request's tokens.

        The last token is never served from the cache: its logits are needed,
        and recomputing it must not write into a block another request shares.
        """
        if not self.enable_prefix_caching:
            return []
        tokens = req.all_token_ids
        usable = (len(tokens) - 1) // self.block_size
        found: list[int] = []
        parent = _ROOT_HASH
        for i in range(usable):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            h = block_hash(parent, chunk)
            bid = self._by_hash.get(h)
            if bid is None or self.blocks[bid].tokens != chunk:
                break
            found.append(bid)
            parent = h
        return found

    def num_new_blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(req.num_computed_tokens + num_new_tokens) - len(req.block_table))

    # ---- allocation ----------------------------------------------------
    def admit(self, req: Request, cached: list[int]) -> None:
        """Give a request its cached prefix blocks (from `match_prefix`)."""
        assert not req.block_table
        self.prefix_queries += req.num_tokens
        for bid in cached:
            self._take(bid)
        req.block_table = list(cached)
        req.block_hashes = [self.blocks[b].hash for b in cached]  # type: ignore[misc]
        req.num_computed_tokens = len(cached) * self.block_size
        if req.num_preemptions == 0:
            req.num_cached_tokens = req.num_computed_tokens
        self.prefix_hits += req.num_computed_tokens

    def can_allocate(self, num_blocks: int, taking: list[int] = ()) -> bool:
        """Whether `num_blocks` fresh blocks fit after taking the cached blocks `taking`."""
        taken_from_free = sum(1 for b in taking if self.blocks[b].ref_count == 0)
        return num_blocks <= self.num_free - taken_from_free

    def ensure_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Grow the block table to hold `num_new_tokens` more tokens; False if blocks run out."""
        need = self.num_new_blocks_needed(req, num_new_tokens)
        if need > self.num_free:
            return False
        for _ in range(need):
            bid, _ = self._free.popitem(last=False)
            block = self.blocks[bid]
            if block.hash is not None:  # evict its cached content
                if self._by_hash.get(block.hash) == bid:
                    del self._by_hash[block.hash]
                block.hash, block.tokens = None, ()
            block.ref_count = 1
            req.block_table.append(bid)
        return True

    def commit(self, req: Request) -> None:
        """Hash the request's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        # Only blocks whose tokens are all known (a pending token's id is not) and computed.
        full = min(req.num_computed_tokens, req.num_known_tokens) // self.block_size
        if len(req.block_hashes) >= full:
            return
        tokens = req.token_ids_slice(len(req.block_hashes) * self.block_size, full * self.block_size)
        parent = req.block_hashes[-1] if req.block_hashes else _ROOT_HASH
        for j, i in enumerate(range(len(req.block_hashes), full)):
            chunk = tuple(tokens[j * self.block_size : (j + 1) * self.block_size])
            h = block_hash(parent, chunk)
            block = self.blocks[req.block_table[i]]
            if block.hash is None:
                block.hash, block.tokens = h, chunk
                self._by_hash.setdefault(h, block.block_id)
            req.block_hashes.append(h)
            parent = h

    def trim(self, req: Request) -> None:
        """Give back the tail blocks past the request's computed tokens (rejected drafts' blocks)."""
        keep = self.blocks_for(req.num_computed_tokens)
        for bid in reversed(req.block_table[keep:]):
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.hash is None, f"block {bid} is shared or hashed"
            self._free[bid] = None
            self._free.move_to_end(bid, last=False)  # nothing cached in it: hand it out first
        if keep < len(req.block_table):
            del req.block_table[keep:]
            req.num_table_trims += 1

    def free(self, req: Request) -> None:
        # Reversed: the tail of a sequence is the least likely to be shared, so it is reused first.
        for bid in reversed(req.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {bid} freed twice"
            if block.ref_count == 0:
                self._free[bid] = None
        req.block_table = []
        req.num_table_trims += 1
        req.block_hashes = []
        req.num_computed_tokens = 0

    def _take(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self._free[bid]
        block.ref_count += 1

    def reset_prefix_cache(self) -> None:
        for bid in self._free:
            self.blocks[bid].hash, self.blocks[bid].tokens = None, ()
        self._by_hash = {h: b for h, b in self._by_hash.items() if self.blocks[b].ref_count > 0}
