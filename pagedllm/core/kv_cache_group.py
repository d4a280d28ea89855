"""One KV cache group: the layers that share a block table (one attention kind), their pool and tables.

A model whose cached layers all attend alike has one group. A hybrid model (Gemma 3: sliding-window layers
and full-attention layers) has two: the full layers need every block of a request, the sliding layers only
the blocks of the window, so each kind gets its own pool and block table per request and the sliding
group frees what fell out of the window. An encoder-decoder model's cross-attention layers get a group whose
tables hold each request's encoder positions (``encoder_tokens``), whatever its decoder length: all of them at
admission, none after, never prefix-cached. ``KVCacheManager`` runs every operation over all groups.
"""

from __future__ import annotations

from pagedllm.core.block_pool import BlockHash, BlockPool, KVCacheBlock


class KVCacheGroup:
    """A block pool plus each request's block table in it; ``sliding_window`` set: blocks that fell out of the
    window are swapped for the null block and freed."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 sliding_window: int | None = None, enable_kv_cache_events: bool = False,
                 encoder_tokens: int = 0) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.encoder_tokens = encoder_tokens  # > 0: the cross-attention group (a fixed size per request)
        self.pool = BlockPool(num_blocks, enable_caching, enable_kv_cache_events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - 1

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Index of the first block a query at position ``num_computed_tokens`` (or later) can still see.

        That query sees keys after ``num_computed_tokens - window``; a block ending at or before that is out
        of every later window. 0 without a window.
        """
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window) // self.block_size

    def longest_hit(self, found: list[KVCacheBlock | None], limit: int) -> int:
        """The most full blocks (<= ``limit``) a new request may take as computed, given the cached block
        ``found[i]`` (or None) for each of its blocks: every block the next query can see must be cached."""
        if self.sliding_window is None:
            n = 0
            while n < limit and found[n] is not None:
                n += 1
            return n
        last_miss, misses = -1, []  # misses[i]: the last block <= i that is not cached (-1: none)
        for i in range(limit):
            if found[i] is None:
                last_miss = i
            misses.append(last_miss)
        for n in range(limit, 0, -1):
            if misses[n - 1] < self.first_needed_block(n * self.block_size):
                return n
        return 0

    def lookup(self, keys: list[tuple[BlockHash, int]]) -> list[KVCacheBlock | None]:
        """The cached block (or None) for each (hash, parent value); a group without a window stops at the
        first miss (nothing after it can be part of its hit)."""
        found: list[KVCacheBlock | None] = []
        for block_hash, parent in keys:
            block = self.pool.lookup(block_hash, parent)
            if block is None and self.sliding_window is None:
                return found + [None] * (len(keys) - len(found))
            found.append(block)
        return found

    def hit_blocks(self, found: list[KVCacheBlock | None], num_hit: int) -> list[KVCacheBlock]:
        """The table entries of a ``num_hit``-block hit: the null block where the window no longer looks."""
        first = self.first_needed_block(num_hit * self.block_size)
        hits = [self.pool.null_block] * first + found[first:num_hit]
        assert all(b is not None for b in hits)
        return hits  # type: ignore[return-value]

    def free_outside_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Swap this request's blocks that no later query can see for the null block and free them."""
        blocks = self.req_to_blocks.get(request_id)
        if self.sliding_window is None or not blocks:
            return
        null = self.pool.null_block
        freed = []
        for i in range(min(self.first_needed_block(num_computed_tokens), len(blocks))):
            if blocks[i] is not null:
                freed.append(blocks[i])
                blocks[i] = null
        if freed:
            self.pool.free_blocks(reversed(freed))

    def num_new_blocks(self, request_id: str, num_tokens: int, hits: list[KVCacheBlock]) -> int:
        """Blocks to take from the pool so the request's table covers ``num_tokens`` tokens (hits included)."""
        held = len(self.req_to_blocks.get(request_id, ()))
        if self.encoder_tokens:
            num_tokens = self.encoder_tokens
        return max(0, -(-num_tokens // self.block_size) - held - len(hits))

    def can_allocate(self, num_new: int, hits: list[KVCacheBlock]) -> bool:
        # Hits that sit in the free queue stop being allocatable once we take them.
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        return num_new <= self.pool.num_free_blocks - num_free_hits

    def allocate(self, request_id: str, num_new: int, hits: list[KVCacheBlock]) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        null = self.pool.null_block
        self.pool.touch(b for b in hits if b is not null)
        blocks.extend(hits)
        new_blocks = self.pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def free(self, request_id: str) -> None:
        """Release the request's blocks (tail first, for LRU order)."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        if blocks:
            null = self.pool.null_block
            self.pool.free_blocks(b for b in reversed(blocks) if b is not null)

    def uncache_from(self, request_id: str, first_block: int) -> None:
        for block in self.req_to_blocks.get(request_id, [])[first_block:]:
            if block is not self.pool.null_block:
                self.pool.uncache(block)
        if request_id in self.num_cached_blocks:
            self.num_cached_blocks[request_id] = min(self.num_cached_blocks[request_id], first_block)
