"""Per-request block tables on top of the block pool, with automatic prefix caching."""

from __future__ import annotations

import random

from pagedllm.core.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block
from pagedllm.core.kv_cache_snapshot import KVCacheSnapshot, build_snapshot
from pagedllm.core.request import Request
from pagedllm.utils import cdiv


class KVCacheManager:
    """Allocates blocks for requests; the scheduler only sees opaque results (blocks or None)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_seed: int | None = None, sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Set when every attention layer slides with this window: blocks that fell out of it are freed.
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_caching)
        # The first block's parent value: random per process unless configured, so hashes can't be
        # predicted across deployments.
        self.root_hash = hash(("pagedllm", hash_seed)) if hash_seed is not None else random.getrandbits(63)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache statistics, counted in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - 1

    def _parent_value(self, request: Request, index: int) -> int:
        return self.root_hash if index == 0 else request.block_hashes[index - 1].value

    def _update_block_hashes(self, request: Request) -> None:
        """Extend the request's chained block hashes to cover all its full blocks."""
        bs = self.block_size
        extra = (request.cache_salt,) if request.cache_salt else ()
        tokens = request.all_token_ids
        while (len(request.block_hashes) + 1) * bs <= len(tokens):
            i = len(request.block_hashes)
            # Only the first block carries the salt; later blocks inherit it through the chain.
            request.block_hashes.append(
                hash_block(self._parent_value(request, i), tuple(tokens[i * bs:(i + 1) * bs]),
                           extra if i == 0 else ()))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks for a new request, and the tokens they cover.

        The last token is always left to compute: its logits are needed to sample.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need the logits of every prompt position
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for i in range(min(max_blocks, len(request.block_hashes))):
            block = self.pool.lookup(request.block_hashes[i], self._parent_value(request, i))
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_new_computed_tokens: int = 0,
                       num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens (after any prefix hits). None if it can't.

        ``num_lookahead_tokens`` more slots are reserved past them (a draft model writes its proposals'
        K/V there); they are never hashed for the prefix cache.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if self.sliding_window is not None and blocks:
            self._free_outside_window(request, blocks)
        total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_needed = (cdiv(total_tokens + num_lookahead_tokens, self.block_size) - len(blocks)
                      - len(new_computed_blocks))
        # Hits that sit in the free queue stop being allocatable once we take them.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_free_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, total_tokens)
        return new_blocks

    def _free_outside_window(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        """Swap blocks that no query of this request can see any more for the null block and free them.

        The next query sits at position ``num_computed_tokens`` and sees keys after
        ``num_computed_tokens - window``; a block ending at or before that is out of every later window.
        """
        null = self.pool.null_block
        num_out = max(0, request.num_computed_tokens - self.sliding_window) // self.block_size
        freed = []
        for i in range(min(num_out, len(blocks))):
            if blocks[i] is not null:
                freed.append(blocks[i])
                blocks[i] = null
        if freed:
            self.pool.free_blocks(reversed(freed))

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        # K/V of these tokens is written during the coming step, before any later step can read it,
        # and within a step every layer writes the whole batch's K/V before attending.
        self._update_block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self.num_cached_blocks.get(request.request_id, 0)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i], self._parent_value(request, i))
        self.num_cached_blocks[request.request_id] = max(start, num_full)

    def free(self, request: Request) -> None:
        """Release a finished, aborted or preempted request's blocks (tail first, for LRU order)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            null = self.pool.null_block
            self.pool.free_blocks(b for b in reversed(blocks) if b is not null)

    def uncache_from(self, request: Request, num_valid_tokens: int) -> None:
        """Forget the prefix-cache entries of the request's blocks past its first ``num_valid_tokens``
        tokens: after a failed step their K/V may be half-written."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        first = num_valid_tokens // self.block_size
        for block in blocks[first:]:
            if block is not self.pool.null_block:
                self.pool.uncache(block)
        if request.request_id in self.num_cached_blocks:
            self.num_cached_blocks[request.request_id] = min(self.num_cached_blocks[request.request_id], first)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    def snapshot(self) -> KVCacheSnapshot:
        """Every block's state and owning request, for the playground's cache map. O(num_blocks)."""
        tables = {rid: [b.block_id for b in blocks] for rid, blocks in self.req_to_blocks.items()}
        return build_snapshot(self.pool.block_states(), self.block_size, tables)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.block_size) <= self.num_usable_blocks


__all__ = ["BlockHash", "KVCacheManager"]
